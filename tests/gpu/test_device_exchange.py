"""alltoall, gather, scatter, reduce and point-to-point messages on device
arrays (gs.DeviceArray) against the same calls on NumPy arrays with the same
inputs: results come back as DeviceArrays on the inputs' device, with the
host results' bytes (the values are small integers, exact on every path).
Runs on a GPU and on the emulated CUDA runtime (make test-emulated)."""
import numpy as np
import pytest

import gradsync as gs
from gsutil import collectively

pytestmark = pytest.mark.mpi


def ints(rank, shape, dtype=np.float32, tag=0):
    rng = np.random.default_rng(1000 * tag + rank)
    return rng.integers(-8, 8, size=shape).astype(dtype)


def dev(a, device):
    return gs.DeviceArray(a.shape, a.dtype, device).copy_from(a)


def same(got, expected, what):
    assert isinstance(got, gs.DeviceArray), f"{what}: {type(got).__name__}, not a DeviceArray"
    host = got.numpy()
    assert host.shape == expected.shape and host.dtype == expected.dtype, what
    assert np.array_equal(host.view(np.uint8), expected.view(np.uint8)), f"{what}: values"


def test_alltoall_uneven_on_device(comm, device):
    P, me = comm.size, comm.rank
    send = [(me + d) % 3 + (d == 0) * 700 for d in range(P)]
    x = ints(me, (sum(send), 3))
    with collectively():
        ref = comm.alltoall(x, send)
        got = comm.alltoall(dev(x, device), send)
        same(got, ref, "alltoall")


def test_gather_scatter_reduce_on_device(comm, device):
    P, me = comm.size, comm.rank
    x = ints(me, (me + 2, 4), tag=1)
    for root in range(P):
        with collectively(what=f"root {root}"):
            ref = comm.gather(x, root=root)
            got = comm.gather(dev(x, device), root=root)
            if me == root:
                same(got, ref, "gather")
                back = comm.scatter(got, root=root, counts=[r + 2 for r in range(P)])
            else:
                assert got is None
                back = comm.scatter(None, root=root, counts=[r + 2 for r in range(P)])
            same(back, x, "scatter of the gathered rows")
            y = ints(me, (1001,), tag=2)
            ref = comm.reduce(y, "sum", root=root, postscale=0.5)
            got = comm.reduce(dev(y, device), "sum", root=root, postscale=0.5)
            if me == root:
                same(got, ref, "reduce")


def test_send_recv_on_device(comm, device):
    P, me = comm.size, comm.rank
    out = dev(ints(me, (3001,), np.float64, tag=3), device)
    into = dev(np.zeros(3001), device)
    with collectively():
        r = comm.recv_async_(into, (me - 1) % P, tag=2)
        comm.send_async(out, (me + 1) % P, tag=2).wait()
        r.wait()
        same(into, ints((me - 1) % P, (3001,), np.float64, tag=3), "ring")
