"""pytest fixtures for the gradsync.torch suite (skipped without torch).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/torch_tests

The collective helpers (collective_assert, collectively, seed_for) come from
tests/python/gsutil.py.
"""
# isort: off
import gradsync as gs  # noqa: F401  (first: it initializes MPI at the level it needs)
# isort: on
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from gsfixtures import comm, import_torch, make_watchdog  # noqa: E402,F401

_watchdog = make_watchdog(180)

torch = import_torch()


import pytest  # noqa: E402

SMALL_THRESHOLD_BYTES = 4096


@pytest.fixture(scope="session")
def torch_pg():
    """torch.distributed's default group on the gradsync backend, created the
    way users do under mpiexec (no store, no environment), once per session
    (test_torch_upstream.py's gloo run leaves none behind). Its fusion
    threshold is 4 KiB, so the tests' larger tensors and lists go out in
    several fused messages."""
    if torch is None:
        pytest.skip("torch is not installed")
    import torch.distributed as dist

    import gradsync.torch.distributed  # noqa: F401  (registers the backend)
    if dist.is_initialized() and dist.get_backend() != "gradsync":
        dist.destroy_process_group()
    if not dist.is_initialized():
        assert not os.environ.get("MASTER_ADDR"), "the tests run without a master address"
        dist.init_process_group("gradsync")
        dist.group.WORLD.comm.fusion_threshold = SMALL_THRESHOLD_BYTES
    yield dist.group.WORLD
