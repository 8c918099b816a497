"""pytest setup shared by every suite under tests/.

Under mpiexec every rank is its own pytest session, and by default they all
number their temporary directories in one /tmp/pytest-of-<user> and prune
each other's old ones at the same moment (pytest then warns that it could
not remove a directory another rank had just removed). Each rank (and a
plain pytest run) gets a base directory of its own instead, removed when its
session ends, and so do the flight records the tests provoke. The rank is
read from the launcher's environment, not from MPI, because some suites
(tests/cluster/test_cluster_faults.py) must not initialize MPI; it only
names the directory.

pytest puts tests/ itself on sys.path (this file is there), so a test folder
named like a package would be imported in its place whenever the package is
not installed: `import torch` found tests/torch as a namespace package and
tests failed with "module 'torch' has no attribute 'from_numpy'" instead of
skipping. The suites' folders are named <package>_tests, and
check_no_shadowing() makes a folder named like a package an error.
"""
import os
import shutil
import sys
import tempfile

import pytest

# The checkout's research benchmarks (bench/, not installed) are imported by
# some tests as `bench.NAME`, as `python -m bench.NAME` runs them from the root.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Packages the suites import, or skip without: no folder under tests/ may
# take one of their names.
PACKAGES = ("torch", "jax", "jaxlib", "horovod", "numpy", "mpi4py", "gradsync", "cupy",
            "ml_dtypes", "hypothesis", "pytest", "expecttest", "pynvml")


def check_no_shadowing(tests_dir=TESTS_DIR):
    """Raises pytest.UsageError naming any folder under tests_dir that has a
    package's name (it would be imported instead of the package)."""
    def importable(path):  # a folder left with only __pycache__ imports nothing
        return os.path.isdir(path) and any(e != "__pycache__" for e in os.listdir(path))
    clash = sorted(n for n in os.listdir(tests_dir)
                   if n in PACKAGES and importable(os.path.join(tests_dir, n)))
    if clash:
        raise pytest.UsageError(
            "tests/ holds folders named like packages the tests import: "
            + ", ".join(f"tests/{n}" for n in clash) + ". pytest puts tests/ on sys.path, so "
            "`import <name>` would find the folder when the package is not installed. "
            "Rename them (the suites are tests/<package>_tests).")


# Hydra (MPICH), Open MPI and PMIx launchers, in that order.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _launcher_rank():
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "extended: runs in make test-extended only")
    check_no_shadowing()
    # tryfirst: pytest's tmpdir plugin reads --basetemp in its own
    # pytest_configure, so it must be set before that runs.
    if config.option.basetemp:
        return
    prefix = "gradsync-pytest-rank%d-" % _launcher_rank()
    config.option.basetemp = tempfile.mkdtemp(prefix=prefix)
    config._gradsync_basetemp = config.option.basetemp
    # Flight records that tests provoke (mismatches, timeouts) and do not
    # direct themselves would go to TMPDIR/gradsync-flight-<job> and stay
    # there: they go under this rank's base directory, removed with it
    # (children started by the tests inherit it).
    os.environ.setdefault("GRADSYNC_FLIGHT_DIR", os.path.join(config.option.basetemp, "flight"))


# Tests that start whole jobs of their own and prove what another tier of
# make test proves too (torch's spawn harness on a sample, the demo under
# torchrun, bench.gpu's dry runs, which gpu-session-dry repeats): marked
# `extended`, they run in `make test-extended` (GS_EXTENDED_TESTS=1) and
# when asked for, and make test says it skipped them.
EXTENDED = os.environ.get("GS_EXTENDED_TESTS", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if EXTENDED:
        return
    skip = pytest.mark.skip(reason="a make test-extended test (GS_EXTENDED_TESTS=1 runs it)")
    for item in items:
        if item.get_closest_marker("extended"):
            item.add_marker(skip)


def pytest_unconfigure(config):
    path = getattr(config, "_gradsync_basetemp", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
