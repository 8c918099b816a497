"""pytest fixtures for the gradsync.torch suite (skipped without torch).

Run with:
    PYTHONPATH=pyx mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/torch

The collective helpers (collective_assert, collectively, seed_for) come from
tests/python/gsutil.py.
"""
import faulthandler
import os
import sys

import pytest

import gradsync as gs
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

WATCHDOG_SECONDS = float(os.environ.get("GS_TEST_WATCHDOG", "180"))

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None
else:
    # several ranks share few cores: one intra-op thread per rank
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def comm():
    """gs.Communicator over COMM_WORLD."""
    c = gs.Communicator(MPI.COMM_WORLD)
    yield c
    c.close()
