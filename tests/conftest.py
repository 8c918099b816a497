"""pytest setup shared by every suite under tests/.

Under mpiexec every rank is its own pytest session, and by default they all
number their temporary directories in one /tmp/pytest-of-<user> and prune
each other's old ones at the same moment (pytest then warns that it could
not remove a directory another rank had just removed). Each rank (and a
plain pytest run) gets a base directory of its own instead, removed when its
session ends. The rank is read from the launcher's environment, not from
MPI, because some suites (tests/cluster/test_cluster_faults.py) must not
initialize MPI; it only names the directory.
"""
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

# pytest puts tests/ on sys.path (this file's folder, in its default import
# mode), where tests/torch and tests/jax are folders of suites: without torch
# or jax installed, "import torch" would find the suite's folder as an empty
# namespace package instead of failing. Make it fail, as it would elsewhere.
for _name in ("torch", "jax"):
    _spec = importlib.util.find_spec(_name) if _name not in sys.modules else None
    if _spec is not None and _spec.origin is None and all(
            os.path.dirname(p) == os.path.dirname(os.path.abspath(__file__))
            for p in _spec.submodule_search_locations or ()):
        sys.modules[_name] = None  # "import torch" raises ImportError

# Hydra (MPICH), Open MPI and PMIx launchers, in that order.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _launcher_rank():
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # tryfirst: pytest's tmpdir plugin reads --basetemp in its own
    # pytest_configure, so it must be set before that runs.
    if config.option.basetemp:
        return
    prefix = "gradsync-pytest-rank%d-" % _launcher_rank()
    config.option.basetemp = tempfile.mkdtemp(prefix=prefix)
    config._gradsync_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    path = getattr(config, "_gradsync_basetemp", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
