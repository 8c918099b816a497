"""gradsync.jax: out-of-place collectives and kernels on JAX arrays, against
float64 NumPy references (every rank regenerates every rank's inputs), with
zero-copy results, and a data-parallel training loop that must match one
process training on the concatenated batch."""
import numpy as np
import pytest
from adasum_reference import adasum_reference, relative_l2_error
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    BF16,
    check_result,
    collectively,
    random_array,
    reduce_reference,
    reduce_tolerance,
    seed_for,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
import gradsync.jax as gsj  # noqa: E402
from gradsync.jax import _plumbing  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
DTYPES = [np.float16, BF16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]
FLOATS = [np.float16, BF16, np.float32, np.float64]
# 0, 1, odd, and past small_comm's 4 KiB fusion threshold
SHAPES = [(0,), (1,), (7, 3), (1500,)]


def values(rank, shape, dtype, tag):
    """Small integers, exact in every dtype and in sums over a few ranks."""
    rng = np.random.default_rng(seed_for("jax", tag, rank))
    low = 0 if np.dtype(dtype).kind == "u" else -8
    return rng.integers(low, 8, size=shape, endpoint=True).astype(dtype)


def powers_of_two(rank, shape, dtype, tag):
    """+-0.5, 1, 2 (1, 2 for unsigned; -1, 1, 2 for signed integers): products
    over four ranks are exact in every dtype."""
    return random_array(np.random.default_rng(seed_for("jax-prod", tag, rank)), shape, dtype,
                        "prod")


def normal(rank, shape, dtype, tag):
    rng = np.random.default_rng(seed_for("jax-normal", tag, rank))
    return (rng.standard_normal(shape) * 4).astype(np.float32).astype(dtype)


def tree_of(rank, dtype, tag, make=values):
    """A pytree (dict of list and array) of every shape."""
    return {"a": [jnp.asarray(make(rank, s, dtype, (tag, i))) for i, s in enumerate(SHAPES[:2])],
            "b": jnp.asarray(make(rank, SHAPES[2], dtype, (tag, 2))),
            "c": jnp.asarray(make(rank, SHAPES[3], dtype, (tag, 3)))}


def np_leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def check_jax(got, like):
    """got: JAX arrays in like's structure, with like's dtypes."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(like)
    for g, want in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(like)):
        assert isinstance(g, jax.Array), type(g)
        assert g.dtype == want.dtype, (g.dtype, want.dtype)


@pytest.fixture
def zero_copy(monkeypatch):
    """Records (gradsync's result, the JAX array made from it) of each call."""
    seen = []
    real = _plumbing._to_jax

    def spy(out):
        j = real(out)
        seen.append((out, j))
        return j
    monkeypatch.setattr(_plumbing, "_to_jax", spy)
    return seen


def assert_zero_copy(seen):
    for out, j in seen:
        if out.size:
            assert j.unsafe_buffer_pointer() == out.ptr, "the JAX result is a copy"


# ------------------------------------------------------------- collectives

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "prod"])
def test_allreduce(dtype, op, small_comm, zero_copy):
    comm = small_comm
    if op == "average" and np.dtype(dtype).kind != "f" and np.dtype(dtype) != BF16:
        pytest.skip("average is for floating dtypes")
    make = powers_of_two if op == "prod" else values
    x = tree_of(comm.rank, dtype, op, make)
    before = [a.copy() for a in np_leaves(x)]
    per_rank = [np_leaves(tree_of(r, dtype, op, make)) for r in range(comm.size)]
    with collectively() as blk:
        out = gsj.allreduce(x, comm, op=op)
        check_jax(out, x)
        got = np_leaves(out)
        for i, g in enumerate(got):
            pr = [p[i] for p in per_rank]
            check_result(g, reduce_reference(pr, op), reduce_tolerance(pr, op), dtype,
                         pr[0].shape, what=f"leaf {i}")
        assert all(b.tobytes() == a.tobytes() for b, a in zip(before, np_leaves(x)))
        assert_zero_copy(zero_copy)
        blk.same(got)


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3"])
def test_allreduce_wire_matches_the_numpy_path(wire, small_comm):
    """gsj.allreduce(..., wire=) is the communicator's wire allreduce on the
    leaves: bit for bit what comm.allreduce gives on the same float32 NumPy
    arrays, two steps with error feedback (each path its own ErrorFeedback),
    and the residuals agree too. The float64 error bound is test_wire.py's."""
    comm = small_comm
    with collectively() as blk:
        ef_jax, ef_np = gs.ErrorFeedback(), gs.ErrorFeedback()
        got = []
        for step in range(2):
            x = tree_of(comm.rank, np.float32, ("wire", step), normal)
            out = gsj.allreduce(x, comm, op="average", wire=wire, residual=ef_jax)
            check_jax(out, x)
            ref = comm.allreduce(np_leaves(x), "average", wire=wire, residual=ef_np)
            for i, (g, r) in enumerate(zip(np_leaves(out), ref)):
                assert g.tobytes() == r.tobytes(), (step, i)
            got += np_leaves(out)
        for a, b in zip(ef_jax.state, ef_np.state):
            assert a.tobytes() == b.tobytes()
        blk.same(got)


def test_allreduce_wire_refuses_max(comm):
    x = {"w": jnp.ones(5, jnp.float32)}
    with pytest.raises(gs.ArgumentError, match="wire"):
        gsj.allreduce(x, comm, op="max", wire="bfloat16")
    comm.barrier()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_allreduce_prescale_postscale(dtype, comm):
    x = [jnp.asarray(normal(comm.rank, (33,), dtype, "scale"))]
    per_rank = [normal(r, (33,), dtype, "scale") for r in range(comm.size)]
    with collectively():
        got = np.asarray(gsj.allreduce(x, comm, op="average", prescale=0.5, postscale=3.0)[0])
        check_result(got, reduce_reference(per_rank, "average", 0.5, 3.0),
                     reduce_tolerance(per_rank, "average", 0.5, 3.0), dtype, (33,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16],
                         ids=lambda d: np.dtype(d).name)
def test_adasum(dtype, comm):
    shapes = [(5,), (64,), (3, 3)]
    x = [jnp.asarray(normal(comm.rank, s, dtype, ("ada", i))) for i, s in enumerate(shapes)]
    with collectively():
        out = gsj.adasum(x, comm)
        for i, s in enumerate(shapes):
            ref = adasum_reference([normal(r, s, dtype, ("ada", i)).astype(np.float64)
                                    for r in range(comm.size)])
            got = np.asarray(out[i]).astype(np.float64)
            assert got.shape == s and out[i].dtype == x[i].dtype
            tol = {np.dtype(np.float64): 1e-13, np.dtype(np.float32): 1e-6}.get(
                np.dtype(dtype), 2e-2)
            assert relative_l2_error(got, ref) <= tol, (i, relative_l2_error(got, ref))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast(dtype, small_comm, zero_copy):
    comm = small_comm
    root = comm.size - 1
    x = tree_of(comm.rank, dtype, "bcast")
    before = [a.copy() for a in np_leaves(x)]
    with collectively():
        out = gsj.broadcast(x, comm, root=root)
        check_jax(out, x)
        for g, r in zip(np_leaves(out), np_leaves(tree_of(root, dtype, "bcast"))):
            assert g.tobytes() == r.tobytes() and g.shape == r.shape
        assert all(b.tobytes() == a.tobytes() for b, a in zip(before, np_leaves(x)))
        assert_zero_copy(zero_copy)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int8, np.int64],
                         ids=lambda d: np.dtype(d).name)
def test_allgather_uneven(dtype, comm, zero_copy):
    def mine(r):  # rank r has r rows (rank 0 none), plus a 1-D array of r + 1
        return [values(r, (r, 3), dtype, "ag0"), values(r, (r + 1,), dtype, "ag1")]
    x = [jnp.asarray(a) for a in mine(comm.rank)]
    with collectively() as blk:
        out = gsj.allgather(x, comm)
        check_jax(out, x)
        for i in range(2):
            ref = np.concatenate([mine(r)[i] for r in range(comm.size)])
            got = np.asarray(out[i])
            assert got.shape == ref.shape and got.tobytes() == ref.tobytes()
        assert_zero_copy(zero_copy)
        blk.same([np.asarray(o) for o in out])


@pytest.mark.parametrize("rows", [0, 1, 7, 1200])
def test_reduce_scatter(rows, small_comm, zero_copy):
    comm = small_comm
    x = jnp.asarray(values(comm.rank, (rows, 2), np.float32, "rs"))
    total = sum(values(r, (rows, 2), np.float32, "rs").astype(np.float64)
                for r in range(comm.size))
    first = sum(rows // comm.size + (r < rows % comm.size) for r in range(comm.rank))
    n = rows // comm.size + (comm.rank < rows % comm.size)
    with collectively():
        out = gsj.reduce_scatter(x, comm, op="sum")
        assert isinstance(out, jax.Array) and out.dtype == jnp.float32
        assert np.array_equal(np.asarray(out), total[first:first + n].astype(np.float32))
        assert_zero_copy(zero_copy)


def test_inputs_are_read_where_they_are(comm):
    """JAX's DLPack export views its own buffer, which gradsync reads: no
    copy on the way in either."""
    x = jnp.arange(64, dtype=jnp.float32)
    with collectively():
        assert np.from_dlpack(x).ctypes.data == x.unsafe_buffer_pointer()
        out = gsj.allreduce(x, comm)
        assert np.array_equal(np.asarray(out), comm.size * np.arange(64, dtype=np.float32))


# ------------------------------------------------------------------ kernels

def test_accumulate_rounds_once(comm):
    """docs/GUIDE.md section 2.8's numbers: float16 acc 1.0 plus float32 grad
    2**-11 + 2**-22 is 1.0009765625 (a cast first would give 1.0)."""
    with collectively():
        acc = {"w": jnp.ones((4,), jnp.float16), "b": jnp.full((2, 2), 3.0, BF16)}
        grad = {"w": jnp.full((4,), 2.0**-11 + 2.0**-22, jnp.float32),
                "b": jnp.full((2, 2), 0.5, jnp.float32)}
        out = gsj.accumulate(acc, grad)
        check_jax(out, acc)
        assert np.all(np.asarray(out["w"]) == np.float16(1.0009765625))
        assert np.all(np.asarray(out["b"]).astype(np.float64) == 3.5)
        assert np.all(np.asarray(acc["w"]) == 1.0)  # inputs untouched
        with pytest.raises(ValueError, match="one pytree structure"):
            gsj.accumulate(acc, [grad["w"], grad["b"]])


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_scale_and_all_finite(dtype, comm):
    with collectively():
        v = normal(comm.rank, (0,), dtype, "s"), normal(comm.rank, (301,), dtype, "s")
        x = [jnp.asarray(a) for a in v]
        out = gsj.scale(x, 0.25)
        check_jax(out, x)
        for o, a in zip(out, v):  # times a power of two: exact
            assert np.asarray(o).tobytes() == (a.astype(np.float64) * 0.25).astype(dtype).tobytes()
        assert gsj.all_finite(x) and gsj.all_finite({"k": x})
        bad = np.array(v[1])
        bad[150] = np.nan
        assert not gsj.all_finite([x[0], jnp.asarray(bad)])


# ------------------------------------------------------------------- errors

def test_refuses_non_jax_leaves(comm):
    """(Tracers: test_jit.py.)"""
    with collectively():
        with pytest.raises(TypeError, match=r"x\['n'\] must be a jax.Array"):
            gsj.scale({"n": np.ones(3)}, 2.0)


def test_bad_leaf_is_named_and_all_ranks_raise(comm):
    """A dtype gradsync lacks on the last rank: that rank's error names the
    pytree path; the other ranks get MismatchError, nobody waits."""
    bad = comm.rank == comm.size - 1
    tree = {"ok": jnp.ones(3), "w": jnp.ones(3, jnp.int16 if bad else jnp.float32)}
    with collectively():
        with pytest.raises((TypeError, gs.MismatchError)) as ei:
            gsj.allreduce(tree, comm)
        if bad:
            assert "int16" in str(ei.value)
            assert "tensors[1] is x['w']" in "".join(getattr(ei.value, "__notes__", []))
        else:
            assert isinstance(ei.value, gs.MismatchError)


@pytest.mark.skipif(WORLD.size < 2, reason="needs two ranks")
def test_structure_mismatch_raises_everywhere(comm):
    tree = [jnp.ones(4)] * (3 if comm.rank == 0 else 2)
    with collectively():
        with pytest.raises(gs.MismatchError):
            gsj.allreduce(tree, comm)


# ---------------------------------------------------------- training loop

def _mlp_init(seed, sizes, dtype):
    rng = np.random.default_rng(seed)
    return [{"w": jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), dtype),
             "b": jnp.zeros((n,), dtype)} for m, n in zip(sizes[:-1], sizes[1:])]


@jax.jit
def _loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


_grad = jax.jit(jax.grad(_loss))
_sgd = jax.jit(lambda p, g: jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g))


@pytest.mark.parametrize("dtype,rtol", [(jnp.float64, 1e-11), (jnp.float32, 2e-5)])
def test_data_parallel_training_equals_one_process(dtype, rtol, comm):
    """Each rank trains on its slice of every batch, averaging gradients
    with gsj.allreduce outside jit; the parameters must be those of one
    process training on the whole batch (and identical on every rank)."""
    sizes, per_rank, steps = [5, 16, 8, 3], 6, 6
    # different initializations on purpose: broadcast makes them rank 0's
    params = _mlp_init(100 + comm.rank, sizes, dtype)
    params = gsj.broadcast(params, comm, root=0)
    ref = _mlp_init(100, sizes, dtype)
    rng = np.random.default_rng(seed_for("jax-train"))
    n = per_rank * comm.size
    x_all = rng.standard_normal((2 * n, 5))          # two batches, taken in turn
    y_all = np.tanh(x_all @ rng.standard_normal((5, 3)))
    batches = [(x_all[k * n:(k + 1) * n], y_all[k * n:(k + 1) * n]) for k in range(2)]
    losses = [float(_loss(ref, jnp.asarray(x_all, dtype), jnp.asarray(y_all, dtype)))]
    mine = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    for step in range(steps):
        xb, yb = batches[step % 2]
        grads = _grad(params, jnp.asarray(xb[mine], dtype), jnp.asarray(yb[mine], dtype))
        grads = gsj.allreduce(grads, comm, op="average")
        params = _sgd(params, grads)
        ref = _sgd(ref, _grad(ref, jnp.asarray(xb, dtype), jnp.asarray(yb, dtype)))
    losses.append(float(_loss(ref, jnp.asarray(x_all, dtype), jnp.asarray(y_all, dtype))))
    with collectively() as blk:
        for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol,
                                       atol=rtol)
        assert losses[-1] < losses[0]  # it did train
        blk.same([np.asarray(p) for p in jax.tree_util.tree_leaves(params)])
