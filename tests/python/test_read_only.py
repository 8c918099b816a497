"""In-place calls and read-only producers (docs/GUIDE.md section 2.1): every in-place
entry point refuses, on every rank and before anything is written, a
non-writeable NumPy array, a DLPack 1.x tensor flagged READ_ONLY, a legacy
capsule (read-only to numpy.from_dlpack too) and a JAX array (when jax
imports); the error names the argument and the out-of-place call. The
out-of-place calls take the same arrays and give the float64 reference."""
import numpy as np
import pytest
from dlpack_producer import READ_ONLY, CtypesProducer, writable_twin
from mpi4py import MPI

import gradsync as gs
from gsutil import collectively

pytestmark = pytest.mark.mpi

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = jnp = None

KINDS = ["numpy", "dlpack1", "legacy", "jax"]
N = 12  # divisible by every size 1..4: the shard calls give each rank a tensor


def base_values(rank):
    return (np.arange(N, dtype=np.float32) + 10 * rank) / 4


class ReadOnly:
    """One rank's read-only argument of one kind over the values
    ``base_values(rank)``; ``unchanged()`` says whether its memory still holds
    them."""

    def __init__(self, kind, rank):
        self.kind = kind
        self.values = base_values(rank)
        self.memory = self.values.copy()
        if kind == "numpy":
            self.memory.flags.writeable = False
            self.obj = self.memory
        elif kind == "dlpack1":
            self.obj = CtypesProducer(self.memory, versioned=True, flags=READ_ONLY)
        elif kind == "legacy":
            self.obj = CtypesProducer(self.memory, versioned=False)
        else:
            self.obj = jnp.asarray(self.values)

    def unchanged(self):
        now = np.asarray(self.obj) if self.kind == "jax" else self.memory
        return now.tobytes() == self.values.tobytes()

    def released(self):
        """Every capsule the ctypes producer made was released once."""
        if isinstance(self.obj, CtypesProducer):
            return self.obj.deleted == self.obj.exported
        return True


def make(kind, rank):
    if kind == "jax" and jax is None:
        pytest.skip("jax does not import")
    return ReadOnly(kind, rank)


def in_place_calls(comm, x, y, g):
    """(what, call, label of x in the error, the out-of-place call named).
    x is read-only; y and g are writable float32 arrays of N elements."""
    return [
        ("allreduce_ list", lambda: comm.allreduce_([y, x]), "tensors[1]", "comm.allreduce("),
        ("allreduce_ one", lambda: comm.allreduce_(x, op="average"), "tensor",
         "comm.allreduce("),
        ("allreduce_async_", lambda: comm.allreduce_async_([y, x]).wait(), "tensors[1]",
         "comm.allreduce("),
        ("broadcast_", lambda: comm.broadcast_([y, x], root=0), "tensors[1]",
         "comm.broadcast("),
        ("broadcast_async_", lambda: comm.broadcast_async_(x).wait(), "tensor",
         "comm.broadcast("),
        ("allgather_shards_", lambda: comm.allgather_shards_([y, x]), "tensors[1]",
         "writable copy"),
        ("allgather_shards_async_", lambda: comm.allgather_shards_async_([y, x]).wait(),
         "tensors[1]", "writable copy"),
        ("reduce_scatter_shards_", lambda: comm.reduce_scatter_shards_([y, x]), "tensors[1]",
         "writable copy"),
        ("reduce_scatter_shards_async_",
         lambda: comm.reduce_scatter_shards_async_([y, x]).wait(), "tensors[1]",
         "writable copy"),
        ("zero_", lambda: gs.zero_([y, x]), "tensors[1]", "zeros_like"),
        ("scale_", lambda: gs.scale_([y, x], 3.0), "tensors[1]", "gradsync.jax.scale"),
        ("accumulate_", lambda: gs.accumulate_([y, x], [g, g]), "acc[1]",
         "gradsync.jax.accumulate"),
        ("accumulate_v2_", lambda: gs.accumulate_v2_(x, g, overwrite=True), "acc",
         "gradsync.jax.accumulate"),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_every_in_place_call_refuses(kind, comm):
    ro = make(kind, comm.rank)
    y = np.full(N, 7.0, np.float32)
    g = np.ones(N, np.float32)
    for what, call, where, instead in in_place_calls(comm, ro.obj, y, g):
        with collectively(what=f"{kind}: {what}"):
            with pytest.raises(ValueError) as ei:
                call()
            assert not isinstance(ei.value, gs.MismatchError), ei.value
            msg = str(ei.value)
            assert msg.startswith(f"{where} is read-only"), msg
            assert instead in msg, msg
            if kind == "jax":
                assert "JAX" in msg, msg
            assert ro.unchanged(), f"{what} wrote into the read-only array"
            assert np.all(y == 7.0) and np.all(g == 1.0), f"{what} wrote into y or g"
    with collectively(what=f"{kind}: still usable"):
        assert ro.released()
        out = comm.allreduce(np.ones(3, np.float32))
        assert np.array_equal(out, np.full(3, comm.size, np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_place_calls_accept(kind, comm):
    ro = make(kind, comm.rank)
    per_rank = np.stack([base_values(r).astype(np.float64) for r in range(comm.size)])
    total = per_rank.sum(axis=0)
    with collectively(what="allreduce"):
        out = comm.allreduce(ro.obj, op="sum")
        assert np.array_equal(out, total.astype(np.float32))
    with collectively(what="allreduce average"):
        out = comm.allreduce([ro.obj], op="average")[0]
        assert np.allclose(out, total / comm.size, rtol=1e-6)
    with collectively(what="broadcast"):
        out = comm.broadcast(ro.obj, root=comm.size - 1)
        assert out.tobytes() == base_values(comm.size - 1).tobytes()
    with collectively(what="allgather"):
        out = comm.allgather(ro.obj)
        assert np.array_equal(out, per_rank.reshape(-1).astype(np.float32))
    with collectively(what="reduce_scatter"):
        out = comm.reduce_scatter(ro.obj)
        rows = N // comm.size
        assert np.array_equal(out, total[comm.rank * rows:(comm.rank + 1) * rows]
                              .astype(np.float32))
    with collectively(what="kernels read it"):
        assert gs.all_finite(ro.obj)
        acc = np.ones(N, np.float64)
        gs.accumulate_(acc, ro.obj)
        assert np.array_equal(acc, 1.0 + base_values(comm.rank).astype(np.float64))
        assert ro.unchanged() and ro.released()


@pytest.mark.skipif(MPI.COMM_WORLD.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("kind", KINDS)
def test_read_only_on_one_rank(kind, comm):
    culprit = comm.size - 1
    ro = make(kind, comm.rank)
    x = ro.obj if comm.rank == culprit else ro.values.copy()
    before = ro.values.copy()
    with collectively():
        with pytest.raises((ValueError, gs.MismatchError)) as ei:
            comm.allreduce_(x)
        if comm.rank == culprit:
            assert "read-only" in str(ei.value) and not isinstance(ei.value, gs.MismatchError)
            assert ro.unchanged()
        else:
            assert isinstance(ei.value, gs.MismatchError), ei.value
            assert x.tobytes() == before.tobytes()


def test_arena_refuses_a_read_only_buffer():
    with collectively():
        arena = gs.Arena([(2, 3), (4,)])
        arena.buffer[:] = 5
        arena.buffer.flags.writeable = False
        with pytest.raises(ValueError, match=r"tensors\[0\] is read-only: the NumPy array"):
            arena.zero_()
        assert np.all(arena.buffer == 5)


def test_the_producer_is_sound():
    """The ctypes producer without READ_ONLY is writable, to NumPy and to
    gradsync: the flag alone is what the refusals above react to."""
    with collectively():
        a = np.arange(6, dtype=np.float32)
        assert writable_twin(a)
        p = CtypesProducer(a, versioned=True, flags=0)
        gs.scale_(p, 2.0)
        assert np.array_equal(a, 2 * np.arange(6, dtype=np.float32))
        assert p.exported == p.deleted == 1
        # NumPy's decisions that gradsync follows
        assert not np.from_dlpack(CtypesProducer(a, versioned=True)).flags.writeable
        assert not np.from_dlpack(CtypesProducer(a, versioned=False, flags=0)).flags.writeable


def test_torch_legacy_capsules_stay_writable(comm):
    """torch has no read-only tensors; before torch 2.9 it exported only legacy
    capsules, and gradsync.torch's DistributedOptimizer writes into them."""
    torch = pytest.importorskip("torch")

    class OldTorchTensor(torch.Tensor):
        __dlpack_c_exchange_api__ = None  # torch < 2.9 has no C exchange API

        def __dlpack__(self, stream=None):  # ... and exports legacy capsules
            return torch.utils.dlpack.to_dlpack(torch.Tensor(self))

    t = torch.ones(4).as_subclass(OldTorchTensor)
    with collectively():
        comm.allreduce_(t)
        assert torch.equal(t.as_subclass(torch.Tensor), torch.full((4,), float(comm.size)))
