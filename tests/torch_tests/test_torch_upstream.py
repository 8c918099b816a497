"""PyTorch's own distributed tests, run on the gradsync backend under mpiexec.

torch ships its collective and DDP tests as methods of
``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``
and normally runs each in freshly spawned processes (TestDistBackend). Here an
adapter runs the same methods in the mpiexec ranks, on one default group per
session: every rank calls the method, the outcome (pass, skip with torch's
reason, fail) is exchanged, and the test fails on every rank if it failed on
any. After a test that failed, or destroyed or broke the default group,
every rank makes a fresh one (torch runs each test in new processes); gloo
gets a fresh one before every test (its tags drift apart once a test made
ranks call different collectives, as torch's monitored_barrier tests do),
gradsync keeps one for the session unless a test failed or broke it.

GS_TORCH_UPSTREAM_BACKEND picks the backend: "gradsync" (the default, and
what `make test` runs) or "gloo", torch's CPU reference, run by this same
harness (MASTER_ADDR/MASTER_PORT set from MPI: rank 0 picks a free port) so
the two can be compared test by test (docs/TORCH_BACKEND.md). For gloo every
skip is torch's decision. For gradsync, torch's decorators decide with
BACKEND="gradsync" after gradsync is added to the feature sets it implements
(DDP, subgroups, GPU and CUDA tensors, a plugin backend), and then:

* CPU tests torch gates by backend name to gloo (or to its MPI backend, or
  to "NCCL & Gloo") run anyway: monitored_barrier, timeouts, sparse
  all_reduce, all_to_all; torch's next check (a GPU count, say) may still
  skip them;
* the group tests torch runs below 8 ranks only for MPI run too;
* test bodies that pick their CPU setup by backend name (BODY_AS) see
  "gloo".

GS_TORCH_UPSTREAM_REPORT=file makes rank 0 append one line per test
(what docs/TORCH_BACKEND.md's tables are made from). EXCLUDED names what
cannot run in this adapter and why.
"""
import importlib.util
import inspect
import os
import shutil
import socket
import sys
import tempfile
import time
import unittest
from datetime import timedelta

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradsync as gs  # noqa: E402

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPI.COMM_WORLD.size < 2,
                                 reason="torch's distributed tests assume two or more ranks")]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
NAME = os.environ.get("GS_TORCH_UPSTREAM_BACKEND", "gradsync")
if NAME not in ("gradsync", "gloo"):
    raise ValueError(f"GS_TORCH_UPSTREAM_BACKEND must be gradsync or gloo, got {NAME!r}")
GRADSYNC = NAME == "gradsync"

os.environ.update(BACKEND=NAME, WORLD_SIZE=str(SIZE),
                  INIT_METHOD="gradsync://" if GRADSYNC else "env://")

from torch.testing._internal import common_distributed as _cd  # noqa: E402

if GRADSYNC:
    for _feature in ("ddp", "subgroup", "plugin", "gpu", "cuda"):
        _cd.DistTestCases.backend_feature[_feature].add("gradsync")

from torch.testing._internal.common_utils import TestCase as _TorchTestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402

import gradsync.torch.distributed  # noqa: E402,F401

BASE = _dt.DistributedTest._DistTestBase
ALL = sorted(n for n in dir(BASE) if n.startswith("test_"))

# CPU tests whose bodies pick their CPU setup by backend name: gradsync runs
# them, and they see "gloo".
BODY_AS = dict.fromkeys(
    {n for n in ALL if n.startswith("test_accumulate_gradients_no_sync")}
    | {"test_get_future", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"},
    "gloo") if GRADSYNC else {}
# Tests torch runs below 8 ranks only for its MPI backend
# (skip_if_small_worldsize reads the environment; the [1, 2] group tests,
# monitored_barrier's with several late ranks): so here too.
SMALL_WORLD_AS_MPI = {n for n in ALL if "cuda" not in n and "@skip_if_small_worldsize"
                      in inspect.getsource(getattr(BASE, n))} if GRADSYNC else set()
# Skips that name a backend, not a capability: gradsync is run anyway.
NAME_GATES = ("Test requires backend gradsync to be one of", "Only MPI supports",
              "Only gloo backend supports", "Only Gloo backend supports",
              "Only Nccl & Gloo backend support")

EXCLUDED = {
    "test_ddp_has_finalized": "expects its process to be killed by NCCL's error handling",
}
# Tests that name ranks a world of two does not have.
NEEDS_THREE = {"test_monitored_barrier_failure_order": "expects rank 2 to be the missing one"}


class Adapter(BASE, _TorchTestCase):
    """_DistTestBase's methods with what TestDistBackend gives them."""

    __test__ = False  # pytest runs the methods through test_upstream only

    rank = RANK
    file_name = None  # in the module's TEMP_DIR (upstream_pg)

    @property
    def world_size(self):
        return os.environ["WORLD_SIZE"]

    def _barrier(self, *args, **kwargs):
        """torch's harness meets in a barrier of files, outside the group.
        gradsync: the default group's barrier (MPI's is not free while
        gradsync's thread may be in MPI), MPI's while there is no default
        group; gloo: MPI's, as torch's, outside the group."""
        if GRADSYNC and dist.is_initialized():
            dist.barrier()  # also waits for the group's queued collectives
        else:
            _quiesce()
            WORLD.Barrier()


# ---------------------------------------------------------------- the default group

_SESSION = {"pg": None}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_world():
    """The session's default group on NAME (collective over MPI's world),
    with the timeout torch's own harness gives it (60 s: a rank left waiting
    by a test that expects a failure elsewhere gives up in time)."""
    timeout = timedelta(seconds=_dt.default_pg_timeout)
    if GRADSYNC:
        dist.init_process_group("gradsync", timeout=timeout)
        dist.group.WORLD.comm.fusion_threshold = 4096  # as tests/torch_tests/conftest.py
    else:  # torch's env:// rendezvous, a TCP store on rank 0
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(RANK),
                          MASTER_PORT=str(WORLD.bcast(_free_port() if RANK == 0 else None)))
        dist.init_process_group("gloo", init_method="env://", rank=RANK, world_size=SIZE,
                                timeout=timeout)
    _SESSION["pg"] = dist.group.WORLD


def _world_ok():
    """Whether the session's default group is in place and usable here."""
    if not dist.is_initialized() or dist.group.WORLD is not _SESSION["pg"]:
        return False
    if GRADSYNC:
        try:
            _SESSION["pg"].comm.probe(tag=0)  # refused once the communicator is unusable
        except gs.Error:
            return False
    return True


def _quiesce(limit=30.0):
    """Waits (up to ``limit`` s) until this rank's gradsync work is done, so
    MPI is free for mpi4py (gradsync runs MPI at THREAD_SERIALIZED)."""
    deadline = time.monotonic() + limit
    while gs._core.requests_pending() and time.monotonic() < deadline:
        time.sleep(0.001)


def _reset_world():
    """A fresh default group on every rank (after a test destroyed or broke it)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
            pass
    WORLD.Barrier()
    _init_world()


@pytest.fixture(scope="module")
def upstream_temp_dir():
    """torch's harness folders (TEMP_DIR: barrier, test_dir, init_dir), one
    for every rank, made by rank 0 and removed after the module's last test."""
    tmp = WORLD.bcast(tempfile.mkdtemp(prefix="gs-torch-tests-") if RANK == 0 else None)
    if RANK == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    WORLD.Barrier()
    os.environ["TEMP_DIR"] = tmp
    Adapter.file_name = os.path.join(tmp, "init_dir", "shared_init_file")
    yield tmp
    _quiesce()
    WORLD.Barrier()  # every rank is done with it
    if RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def upstream_pg(upstream_temp_dir):
    """The default group on NAME: gradsync's of the session when the other
    torch test modules made one (conftest's torch_pg), else one of this
    module's own; gloo's is destroyed at the end."""
    if GRADSYNC and dist.is_initialized() and dist.get_backend() == "gradsync":
        _SESSION["pg"] = dist.group.WORLD
    else:
        _reset_world()
    yield _SESSION["pg"]
    if not GRADSYNC:
        _quiesce()
        dist.destroy_process_group()


# ---------------------------------------------------------------- running one test

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
        by_name = GRADSYNC and (why or "").startswith(NAME_GATES) \
            and "cuda" not in name and "nccl" not in name
        if not by_name and name not in BODY_AS:
            return why or "skipped by torch"
    source = inspect.getsource(method)
    if SIZE < 3 and "_init_group_test" in source:
        return "torch's group tests use ranks [1, 2]: needs 3 ranks"
    if SIZE < 3 and name in NEEDS_THREE:
        return f"{NEEDS_THREE[name]}: needs 3 ranks"
    if "torchvision" in source and importlib.util.find_spec("torchvision") is None:
        return "needs torchvision"
    return None


def _run(name, method):
    """('pass' | 'skip' | 'fail', message) of one upstream test on this rank."""
    case = Adapter(name)
    saved = _dt.BACKEND
    try:
        _dt.BACKEND = BODY_AS.get(name, saved)
        os.environ["BACKEND"] = "mpi" if name in SMALL_WORLD_AS_MPI else NAME
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
        os.environ["BACKEND"] = NAME


@pytest.mark.parametrize("name", ALL)
def test_upstream(name, upstream_pg):
    method = getattr(BASE, name)
    why = _why_not(name, method)
    if why:
        _report(name, "skip", why)
        pytest.skip(why)
    if not GRADSYNC:  # gloo's tags drift apart once ranks made different calls
        _reset_world()
    status, message = _run(name, method)
    _quiesce()  # the rank's gradsync work is done before mpi4py talks
    outcomes = WORLD.allgather((status, message, _world_ok()))
    if not all(ok and s != "fail" for s, _, ok in outcomes):
        _reset_world()  # torch runs each test on a group of its own
    final = "fail" if any(s == "fail" for s, _, _ in outcomes) else \
        "skip" if all(s == "skip" for s, _, _ in outcomes) else "pass"
    _report(name, final, outcomes[0][1] if final == "skip" else "")
    failed = [(r, m) for r, (s, m, _) in enumerate(outcomes) if s == "fail"]
    if failed:
        pytest.fail("\n".join(f"rank {r}: {m}" for r, m in failed), pytrace=False)
    if all(s == "skip" for s, _, _ in outcomes):
        pytest.skip(outcomes[0][1] or "skipped by torch")


if __name__ == "__main__":  # pragma: no cover - for listing the outcomes by hand
    sys.exit(pytest.main([__file__, "-q"]))
