"""The stall warning: a rank that arrives late makes the lowest waiting rank
print one line naming the operation, its tensor count and bytes, and the late
rank; the call then completes normally."""
import os
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collective_assert

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPI.COMM_WORLD.size < 2, reason="needs a late rank")]


def test_late_rank_is_named():
    late = MPI.COMM_WORLD.size - 1
    x = [np.ones(1000, np.float32), np.ones(24, np.float32)]  # 4096 bytes
    with tempfile.TemporaryFile(mode="w+") as log, gs.Communicator(stall_seconds=0.5) as comm:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # the warning is C's fprintf(stderr)
        try:
            if comm.rank == late:
                time.sleep(2.0)
            comm.allreduce_(x)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read()
        size = comm.size
    lines = [ln for ln in text.splitlines() if "WARNING" in ln]
    if MPI.COMM_WORLD.rank == 0:
        ok = (len(lines) == 1 and "allreduce" in lines[0] and "2 tensors" in lines[0]
              and "4096 bytes" in lines[0] and f"ranks not arrived: {late}" in lines[0])
    else:
        ok = not lines  # only the lowest waiting rank speaks
    collective_assert(ok, f"stall warning on rank {MPI.COMM_WORLD.rank}: {text!r}")
    collective_assert(bool(np.all(x[0] == size)), "the stalled call must still complete")


def test_no_warning_when_nobody_is_late():
    with tempfile.TemporaryFile(mode="w+") as log, gs.Communicator(stall_seconds=5) as comm:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            comm.allreduce_(np.ones(10))
            comm.barrier()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read()
    collective_assert("WARNING" not in text, text)
