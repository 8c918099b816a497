"""Fixtures shared by the conftest.py files of tests/python, tests/torch_tests and
tests/gpu (each imports what it uses into its own namespace)."""
import faulthandler
import os

import pytest
from mpi4py import MPI

import gradsync as gs

SMALL_THRESHOLD = 4096


def import_torch():
    """torch, set to one intra-op thread (several ranks share few cores), or
    None when it is not installed (the torch suites then skip themselves)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def make_watchdog(default_seconds):
    """An autouse fixture: a test that hangs (a rank left waiting in a
    collective) dumps every thread's stack and exits this rank, so mpiexec
    tears the job down instead of sitting until the outer timeout.
    GS_TEST_WATCHDOG overrides the limit."""
    seconds = float(os.environ.get("GS_TEST_WATCHDOG", default_seconds))

    @pytest.fixture(autouse=True)
    def _watchdog():
        faulthandler.dump_traceback_later(seconds, exit=True)
        yield
        faulthandler.cancel_dump_traceback_later()

    return _watchdog


@pytest.fixture(scope="session")
def comm():
    """gs.Communicator over COMM_WORLD (default fusion threshold)."""
    c = gs.Communicator(MPI.COMM_WORLD)
    yield c
    c.close()


@pytest.fixture(scope="session")
def small_comm():
    """gs.Communicator over COMM_WORLD with a 4 KiB fusion threshold, so small
    lists already go out in several fused messages."""
    c = gs.Communicator(MPI.COMM_WORLD, fusion_threshold=SMALL_THRESHOLD)
    yield c
    c.close()
