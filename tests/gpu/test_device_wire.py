"""comm.allreduce_(..., wire=...) on CUDA memory (issue 32, item 5): the
encoding fused into the pack kernel, the exchanges grouped sends and
receives (NCCL) or the MPI device paths, the decoding fused into the unpack.
Results must have the bits of the independent NumPy/ml_dtypes reference
(tests/python/wire_ref.py) and of the host path on the same inputs, on every
rank; error feedback's residuals, kept in device memory, must match the
host path's after every step. Runs on a GPU and on the emulated CUDA
runtime (make test-emulated: staged MPI, CUDA-aware MPI and emulated NCCL)."""
import numpy as np
import pytest
from wire_ref import wire_reference

import gradsync as gs
from gsutil import BF16, collectively, seed_for

pytestmark = pytest.mark.mpi

WIRES = ["bfloat16", "float16", "float8_e4m3", "float8_e5m2"]


def inputs(tag, rank, n, dtype=np.float32, scale=3.0):
    rng = np.random.default_rng(seed_for("device-wire", tag, rank))
    return (rng.standard_normal(n) * scale).astype(dtype)


def dev(a, device):
    return gs.DeviceArray(a.shape, a.dtype, device).copy_from(a)


def same_bits(got, ref):
    g = np.ascontiguousarray(got).view(np.uint8)
    r = np.ascontiguousarray(ref).view(np.uint8)
    return g.shape == r.shape and bool((g == r).all())


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_device_matches_reference(comm, device, wire, op):
    """Sizes 1, odd, a block and one more, and past the fusion threshold;
    in place and into new arrays."""
    c = gs.Communicator(fusion_threshold=4096)
    p, r = c.size, c.rank
    try:
        for n in [1, 31, 33, 1001, 5003]:
            per_rank = [inputs((wire, op, n), q, n) for q in range(p)]
            ref = wire_reference(per_rank, wire, op)
            with collectively(what=f"n={n}") as blk:
                x = dev(per_rank[r], device)
                c.allreduce_(x, op, wire=wire)
                got = x.numpy()
                assert same_bits(got, ref), (n, float(np.abs(got - ref).max()))
                blk.same(got)
            with collectively(what=f"allreduce n={n}"):
                x = dev(per_rank[r], device)
                out = c.allreduce(x, op, wire=wire)
                assert isinstance(out, gs.DeviceArray)
                assert same_bits(out.numpy(), ref) and same_bits(x.numpy(), per_rank[r])
    finally:
        c.close()


@pytest.mark.parametrize("wire", WIRES)
def test_device_fused_list(comm, device, wire):
    """Separate device arrays fused into one message (a block spans two
    tensors), an empty one among them, and one over the threshold alone."""
    c = gs.Communicator(fusion_threshold=4096)
    p, r = c.size, c.rank
    sizes = [100, 0, 37, 5003, 3]
    per = [[inputs((wire, "list", k), q, n) for q in range(p)] for k, n in enumerate(sizes)]
    try:
        with collectively() as blk:
            xs = [dev(per[k][r], device) for k in range(len(sizes))]
            c.allreduce_(xs, wire=wire)
            got = [x.numpy() for x in xs]
            # the plan: [100, 0, 37, 3] fused in one message, 5003 alone
            fused = [0, 1, 2, 4]
            ref = wire_reference([np.concatenate([per[k][q] for k in fused]) for q in range(p)],
                                 wire)
            assert same_bits(np.concatenate([got[k] for k in fused]), ref)
            assert same_bits(got[3], wire_reference(per[3], wire))
            blk.same(np.concatenate(got))
    finally:
        c.close()


@pytest.mark.parametrize("wire", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_device_half_inputs_fp8_wire(comm, device, wire, dtype):
    p, r = comm.size, comm.rank
    per_rank = [inputs((wire, str(dtype)), q, 333, dtype) for q in range(p)]
    ref = wire_reference(per_rank, wire, "average", dtype)
    with collectively() as blk:
        x = dev(per_rank[r], device)
        comm.allreduce_(x, "average", wire=wire)
        got = x.numpy()
        assert got.dtype == np.dtype(dtype) and same_bits(got, ref)
        blk.same(got)


@pytest.mark.parametrize("wire", WIRES)
def test_device_error_feedback_matches_host(comm, device, wire):
    """Three steps with residuals: the device's results and residuals (in
    device memory, made by gs.ErrorFeedback) equal the host path's with
    host residuals, bit for bit; prescale and average on."""
    r = comm.rank
    host_ef, dev_ef = gs.ErrorFeedback(), gs.ErrorFeedback()
    with collectively():
        for step in range(3):
            a = inputs((wire, "ef-a", step), r, 70, scale=0.01 * (step + 1))
            b = inputs((wire, "ef-b", step), r, 45)
            ha, hb = a.copy(), b.copy()
            comm.allreduce_([ha, hb], "average", prescale=0.5, wire=wire, residual=host_ef)
            da, db = dev(a, device), dev(b, device)
            comm.allreduce_([da, db], "average", prescale=0.5, wire=wire, residual=dev_ef)
            assert same_bits(da.numpy(), ha) and same_bits(db.numpy(), hb), f"step {step}"
            res = dev_ef.state
            assert all(isinstance(x, gs.DeviceArray) for x in res)
            for k in range(2):
                assert same_bits(res[k].numpy(), host_ef.state[k]), f"residual {k}, step {step}"
            assert np.abs(host_ef.state[0]).max() > 0  # something was fed back


def test_device_large_message_segments(comm, device):
    """A message past one segment (2^23 elements) against the host path."""
    n = (1 << 23) + 4097
    x = inputs("large", comm.rank, n)
    with collectively() as blk:
        h = x.copy()
        comm.allreduce_(h, wire="bfloat16")
        d = dev(x, device)
        comm.allreduce_(d, wire="bfloat16")
        got = d.numpy()
        assert same_bits(got, h)
        blk.same(got[::4096])


def test_device_refusals(comm, device):
    """A host residual for device tensors, min, and a dtype the wire does
    not take: clear errors naming the argument, the tensor untouched."""
    x0 = inputs("refuse", comm.rank, 40)
    x = dev(x0, device)
    with collectively():
        with pytest.raises(gs.ArgumentError, match=r"residual\[0\].*CUDA device"):
            comm.allreduce_(x, wire="bfloat16", residual=[np.zeros(40, np.float32)])
        with pytest.raises(gs.ArgumentError, match="op min"):
            comm.allreduce_(x, "min", wire="bfloat16")
        with pytest.raises(gs.DtypeError, match="float16"):
            comm.allreduce_(dev(x0.astype(np.float16), device), wire="bfloat16")
        assert same_bits(x.numpy(), x0)
