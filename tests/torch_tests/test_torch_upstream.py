"""PyTorch's own distributed tests, run on the gradsync backend under mpiexec.

torch ships its collective and DDP tests as methods of
``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``
and normally runs each in freshly spawned processes (TestDistBackend). Here an
adapter runs the same methods in the mpiexec ranks, on the session's default
group: every rank calls the method, the outcome (pass, skip with torch's
reason, fail) is exchanged, and the test fails on every rank if it failed on
any. torch's decorators decide skips with BACKEND="gradsync" after gradsync is
added to the feature sets it implements (DDP, subgroups, a plugin backend)
and to the one it lacks (send/recv from any source). Tests torch limits to
its MPI backend on CPU ("Only MPI supports ...": all_to_all) run anyway,
since gradsync is that kind of backend, and so do the group tests torch runs
below 8 ranks only for MPI; test bodies that pick their CPU setup by backend
name (BODY_AS) see "gloo" there.

Every method runs, at 2-4 ranks (torch's tests assume at least two);
docs/TORCH_BACKEND.md lists the outcomes. EXCLUDED names what cannot run in
this adapter and why; every other skip is torch's own decision, with its
reason.
"""
import importlib.util
import inspect
import os
import sys
import tempfile
import unittest

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPI.COMM_WORLD.size < 2,
                                 reason="torch's distributed tests assume two or more ranks")]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size

_tmp = WORLD.bcast(tempfile.mkdtemp(prefix="gs-torch-tests-") if RANK == 0 else None)
if RANK == 0:
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(_tmp, sub), exist_ok=True)
WORLD.Barrier()
os.environ.update(BACKEND="gradsync", WORLD_SIZE=str(SIZE), TEMP_DIR=_tmp,
                  INIT_METHOD="gradsync://")

from torch.testing._internal import common_distributed as _cd  # noqa: E402

for _feature in ("ddp", "subgroup", "plugin"):
    _cd.DistTestCases.backend_feature[_feature].add("gradsync")
_cd.DistTestCases.skip_collective["sendrecv anysource"].add("gradsync")

from torch.testing._internal.common_utils import TestCase as _TorchTestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402

import gradsync.torch.distributed  # noqa: E402,F401

BASE = _dt.DistributedTest._DistTestBase
ALL = sorted(n for n in dir(BASE) if n.startswith("test_"))

# CPU tests torch enables for gloo/mpi by name only: gradsync runs them, and
# their bodies, which pick their CPU setup by that name, see "gloo".
RUN_ANYWAY = {n for n in ALL if n.startswith("test_accumulate_gradients_no_sync")} | {
    "test_get_future", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"}
BODY_AS = dict.fromkeys(RUN_ANYWAY, "gloo")
# Group tests ([1, 2] of the world) torch runs at any size only for its MPI
# backend (skip_if_small_worldsize reads the environment): so here too.
SMALL_WORLD_AS_MPI = {n for n in ALL if "_group" in n and "full_group" not in n
                      and "cuda" not in n}

EXCLUDED = {
    "test_destroy_group": "destroys and recreates groups the session shares",
    "test_destroy_full_group": "destroys and recreates groups the session shares",
    "test_ddp_has_finalized": "expects its process to be killed by NCCL's error handling",
}

class Adapter(BASE, _TorchTestCase):
    """_DistTestBase's methods with what TestDistBackend gives them."""

    __test__ = False  # pytest runs the methods through test_upstream only

    rank = RANK
    file_name = os.path.join(_tmp, "init_dir", "shared_init_file")

    @property
    def world_size(self):
        return os.environ["WORLD_SIZE"]

    def _barrier(self, *args, **kwargs):
        dist.barrier()  # also waits for the group's queued collectives


def _report(name, status, message):
    """GS_TORCH_UPSTREAM_REPORT=file: rank 0 appends `status name: message`
    lines (what docs/TORCH_BACKEND.md's table is made from)."""
    path = os.environ.get("GS_TORCH_UPSTREAM_REPORT")
    if path and RANK == 0:
        with open(path, "a") as f:
            f.write(f"{status} {name}: {message.splitlines()[0] if message else ''}\n")


def _skip_reason(code):
    for skip in _cd.TEST_SKIPS.values():
        if skip.exit_code == code:
            return skip.message
    return None


def _why_not(name, method):
    """The reason this test cannot run here, or None."""
    if name in EXCLUDED:
        return EXCLUDED[name]
    why = getattr(method, "__unittest_skip_why__", None)
    if getattr(method, "__unittest_skip__", False):
        only_mpi = (why or "").startswith("Only MPI supports") and "cuda" not in name
        cpu_by_name = (why or "").startswith("Test requires backend gradsync to be one of") \
            and "'gloo'" in why and "cuda" not in name and "nccl" not in name \
            and "monitored_barrier" not in name  # gloo's own: names the late rank
        if not (only_mpi or cpu_by_name) and name not in RUN_ANYWAY:
            return why or "skipped by torch"
    source = inspect.getsource(method)
    if SIZE < 3 and "_init_group_test" in source:
        return "torch's group tests use ranks [1, 2]: needs 3 ranks"
    if "torchvision" in source and importlib.util.find_spec("torchvision") is None:
        return "needs torchvision"
    return None


def _run(name, method):
    """('pass' | 'skip' | 'fail', message) of one upstream test on this rank."""
    case = Adapter(name)
    saved = _dt.BACKEND
    try:
        _dt.BACKEND = BODY_AS.get(name, saved)
        os.environ["BACKEND"] = "mpi" if name in SMALL_WORLD_AS_MPI else "gradsync"
        case.setUp()  # torch's TestCase: seeds every rank's RNG alike
        try:
            method(case)
        finally:
            case.tearDown()
        return "pass", ""
    except unittest.SkipTest as exc:
        return "skip", str(exc)
    except SystemExit as exc:  # torch's GPU-count checks exit with a skip code
        reason = _skip_reason(exc.code)
        return ("skip", reason) if reason else ("fail", f"SystemExit({exc.code})")
    except BaseException as exc:  # noqa: BLE001 - reported on every rank
        return "fail", f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        _dt.BACKEND = saved
        os.environ["BACKEND"] = "gradsync"


@pytest.mark.parametrize("name", ALL)
def test_upstream(name, torch_pg):
    method = getattr(BASE, name)
    why = _why_not(name, method)
    if why:
        _report(name, "skip", why)
        pytest.skip(why)
    status, message = _run(name, method)
    dist.barrier()  # the rank's gradsync work is done before mpi4py talks
    outcomes = WORLD.allgather((status, message))
    final = "fail" if any(s == "fail" for s, _ in outcomes) else \
        "skip" if all(s == "skip" for s, _ in outcomes) else "pass"
    _report(name, final, outcomes[0][1] if final == "skip" else "")
    failed = [(r, m) for r, (s, m) in enumerate(outcomes) if s == "fail"]
    if failed:
        pytest.fail("\n".join(f"rank {r}: {m}" for r, m in failed), pytrace=False)
    if all(s == "skip" for s, _ in outcomes):
        pytest.skip(outcomes[0][1] or "skipped by torch")


if __name__ == "__main__":  # pragma: no cover - for listing the outcomes by hand
    sys.exit(pytest.main([__file__, "-q"]))
