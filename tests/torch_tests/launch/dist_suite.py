"""torch's own distributed suite (DistributedTest._DistTestBase, from the
installed wheel) through torch's own harness (TestDistBackend: every test
starts WORLD_SIZE fresh processes that rendezvous through file://), on the
"gradsync" backend or on gloo for comparison: `make torch-upstream-spawn`,
and tests/torch_tests/test_launch.py in `make test`.

``BACKEND=gradsync WORLD_SIZE=3 python dist_suite.py [unittest args, -k PATTERN]``
(not under mpiexec: the ranks are MPI singletons that gradsync joins). For
gradsync, torch's decorators decide every skip after "gradsync" is added to
the feature sets it implements (DDP, subgroups, plugin, GPU, CUDA), as the
mpiexec adapter does (tests/torch_tests/test_torch_upstream.py); nothing else
is changed, so the counts are torch's harness's own.

GS_SPAWN_START_METHOD: "spawn" (torch's own choice, the default) or
"forkserver": the ranks then fork from a server that imported torch's test
module once, instead of each importing it afresh (4 s of CPU per rank per
test here, most of the suite's time on two cores); each rank is still a new
process that has run no test and starts MPI itself.

GS_SPAWN_REPORT=file appends one `status name: reason` line per test
(pass, skip, fail), the format of the mpiexec adapter's report.
"""
import os
import sys
import unittest

os.environ.setdefault("BACKEND", "gradsync")
os.environ.setdefault("WORLD_SIZE", "2")
# Any non-empty CI puts torch's run_tests in its CI mode, which writes XML
# reports through xmlrunner (not a dependency here): this harness is run
# for its counts, not for torch's CI reports.
os.environ.pop("CI", None)

from torch.testing._internal import common_distributed as _cd  # noqa: E402

if os.environ["BACKEND"] == "gradsync":
    for _feature in ("ddp", "subgroup", "plugin", "gpu", "cuda"):
        _cd.DistTestCases.backend_feature[_feature].add("gradsync")

import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import gradsync.torch.distributed  # noqa: E402,F401  (registers "gradsync")

START_METHOD = os.environ.get("GS_SPAWN_START_METHOD", "spawn")
if START_METHOD not in ("spawn", "forkserver"):
    raise ValueError(f"GS_SPAWN_START_METHOD must be spawn or forkserver, got {START_METHOD!r}")
PRELOAD = "torch.testing._internal.distributed.distributed_test"


class _ForkServerProcess(torch.multiprocessing.get_context("forkserver").Process):
    """A forkserver child with the environment the parent has when the test
    starts it, as a spawned child has: torch's setUp points TEMP_DIR at a new
    folder for every test, after the fork server took its copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's setUp makes each test's TEMP_DIR (its tearDown removes it) and
    the rendezvous file the ranks' FileStore uses, which nothing removes: a
    test the ranks skip never opens the store that would delete it. The
    tearDown here removes it."""

    def setUp(self):
        super().setUp()
        if START_METHOD == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(_ForkServerProcess)

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except FileNotFoundError:
            pass


def _report_outcomes(path):
    """Every test's outcome, one line each, from unittest's own result
    calls (whatever runner torch's run_tests picks)."""
    base = unittest.TestResult

    def hooked(status, original):
        def add(self, test, *details):
            original(self, test, *details)
            why = str(details[0]).strip().splitlines() if status == "skip" and details else []
            with open(path, "a") as f:
                f.write(f"{status} {test.id().split('.')[-1]}: {why[0] if why else ''}\n")
        return add

    for status, name in (("pass", "addSuccess"), ("skip", "addSkip"), ("fail", "addFailure"),
                         ("fail", "addError"), ("fail", "addUnexpectedSuccess"),
                         ("pass", "addExpectedFailure")):
        setattr(base, name, hooked(status, getattr(base, name)))


if __name__ == "__main__":
    if os.environ.get("GS_SPAWN_REPORT"):
        _report_outcomes(os.environ["GS_SPAWN_REPORT"])
    if START_METHOD == "forkserver":
        torch.multiprocessing.set_forkserver_preload([PRELOAD])
    sys.exit(run_tests())
