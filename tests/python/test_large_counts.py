"""Tensors over 2**31 elements: every count is 64-bit, and MPI calls are
split into chunks that MPI's int counts can carry.

Each rank holds about 2 GiB here, so these run at 1 and 2 ranks only (the
suite also runs at 3 and 4, where they skip): the code path does not depend on
the rank count, and 4 ranks on a 2-core machine would spend minutes copying.
GS_TEST_LARGE=0 skips them. (gs_reduce and gs_alltoallv take the same chunked
paths past GRADSYNC_MPI_MAX_COUNT elements; tests/c/test_exchange.c lowers that
limit to reach them with small arrays.)
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from gsutil import collective_assert

BIG = 2**31 + 77  # just past int32: forces the chunked path, odd tail chunk
WORLD = MPI.COMM_WORLD

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(WORLD.size > 2 or os.environ.get("GS_TEST_LARGE", "1") == "0",
                       reason="large-count tests run at 1 and 2 ranks"),
]


def _stamp(a, rank):
    """Distinct small values at the places where chunks begin and end."""
    idx = np.array([0, 1, 2**30 - 1, 2**30, 2**31 - 1, 2**31, BIG - 1], dtype=np.int64)
    a[idx] = (idx % 5 + rank + 1).astype(a.dtype)
    return idx


def test_allreduce_over_2_31_elements(comm):
    a = np.ones(BIG, dtype=np.uint8)
    idx = _stamp(a, comm.rank)
    comm.allreduce_(a, op="sum")
    expected_at_idx = sum((idx % 5 + r + 1) for r in range(comm.size))
    ok = bool(np.all(a[idx] == expected_at_idx.astype(np.uint8)))
    a[idx] = comm.size  # the rest must be exactly size everywhere
    ok = ok and bool(np.all(a == comm.size))
    collective_assert(ok, "allreduce of 2**31+77 uint8 elements is wrong")


def test_broadcast_over_2_31_elements(comm):
    a = np.full(BIG, comm.rank + 1, dtype=np.int8)
    idx = _stamp(a, 7)  # root's stamps
    if comm.rank != 0:
        a[idx] = 0
    comm.broadcast_(a, root=0)
    ok = bool(np.all(a[idx] == (idx % 5 + 8).astype(np.int8)))
    a[idx] = 1
    collective_assert(ok and bool(np.all(a == 1)), "broadcast of 2**31+77 int8 elements is wrong")


@pytest.mark.skipif(WORLD.size != 2, reason="needs two ranks to pass int32 in total")
def test_allgather_past_int32_total(comm):
    n = 2**30 + 3 + comm.rank  # each below int32; the gathered total is above
    a = np.full(n, comm.rank + 1, dtype=np.uint8)
    a[-1] = 9
    out = comm.allgather(a)
    n0 = 2**30 + 3
    ok = out.shape == (2 * n0 + 1,)
    ok = ok and out[n0 - 1] == 9 and out[-1] == 9 and out[0] == 1 and out[n0] == 2
    out[n0 - 1] = 1
    out[-1] = 2
    ok = ok and bool(np.all(out[:n0] == 1)) and bool(np.all(out[n0:] == 2))
    collective_assert(bool(ok), "allgather past 2**31 total elements is wrong")


@pytest.mark.skipif(WORLD.size != 2, reason="needs two ranks to pass int32 in total")
def test_gather_past_int32_total(comm):
    n = 2**30 + 3 + comm.rank
    a = np.full(n, comm.rank + 1, dtype=np.uint8)
    a[-1] = 9
    out = comm.gather(a, root=1, counts=[2**30 + 3, 2**30 + 4])
    ok = True
    if comm.rank == 1:
        n0 = 2**30 + 3
        ok = out.shape == (2 * n0 + 1,) and out[n0 - 1] == 9 and out[-1] == 9
        out[n0 - 1] = 1
        out[-1] = 2
        ok = ok and bool(np.all(out[:n0] == 1)) and bool(np.all(out[n0:] == 2))
    collective_assert(bool(ok), "gather past 2**31 total elements is wrong")


@pytest.mark.skipif(WORLD.size != 2, reason="a pair of ranks")
def test_send_recv_over_2_31_elements(comm):
    if comm.rank == 0:
        a = np.zeros(BIG, dtype=np.uint8)
        idx = _stamp(a, 3)
        comm.send(a, 1, tag=1)
        ok = True
    else:
        a = np.zeros(BIG, dtype=np.uint8)
        comm.recv_(a, 0, tag=1)
        idx = np.array([0, 1, 2**30 - 1, 2**30, 2**31 - 1, 2**31, BIG - 1], dtype=np.int64)
        ok = bool(np.all(a[idx] == (idx % 5 + 4).astype(np.uint8)))
        a[idx] = 0
        ok = ok and not a.any()
    collective_assert(ok, "send/recv of 2**31+77 uint8 elements is wrong")
