"""torch's own distributed suite (DistributedTest._DistTestBase, from the
installed wheel) through torch's own spawn harness (TestDistBackend: every
test spawns WORLD_SIZE fresh processes that rendezvous through file://),
on the "gradsync" backend or on gloo for comparison: `make torch-upstream-spawn`.

``BACKEND=gradsync WORLD_SIZE=3 python dist_suite.py [unittest args, -k PATTERN]``
(not under mpiexec: the ranks are MPI singletons that gradsync joins). For
gradsync, torch's decorators decide every skip after "gradsync" is added to
the feature sets it implements (DDP, subgroups, plugin, GPU, CUDA), as the
mpiexec adapter does (tests/torch_tests/test_torch_upstream.py); nothing else
is changed, so the counts are torch's harness's own.
"""
import os
import sys
import tempfile

os.environ.setdefault("BACKEND", "gradsync")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="gs-dist-suite-"))
# Any non-empty CI puts torch's run_tests in its CI mode, which writes XML
# reports through xmlrunner (not a dependency here): this harness is run
# for its counts, not for torch's CI reports.
os.environ.pop("CI", None)

from torch.testing._internal import common_distributed as _cd  # noqa: E402

if os.environ["BACKEND"] == "gradsync":
    for _feature in ("ddp", "subgroup", "plugin", "gpu", "cuda"):
        _cd.DistTestCases.backend_feature[_feature].add("gradsync")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import gradsync.torch.distributed  # noqa: E402,F401  (registers "gradsync")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
