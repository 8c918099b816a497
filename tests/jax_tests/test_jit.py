"""gradsync.jax inside jax.jit (issue 49, DESIGN.md section 18): the
collectives lowered to XLA FFI calls give bit for bit what the same call
gives outside jit (whose results test_jax.py checks against float64 NumPy),
jax.grad through them equals the analytic gradient, they work under vmap,
lax.scan and lax.cond, keep program order, and a mismatch raises on every
rank."""
import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import BF16, collectively, reduce_reference, run_child, seed_for

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
from test_jax import DTYPES, normal, np_leaves, powers_of_two, tree_of, values  # noqa: E402

import gradsync.jax as gsj  # noqa: E402

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(gsj.jit_available() is not None,
                                 reason=f"no collectives inside jit: {gsj.jit_available()}")]

WORLD = MPI.COMM_WORLD


def same_bits(got, want):
    """Every leaf of got equal to want's in shape, dtype and bytes."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for i, (g, w) in enumerate(zip(np_leaves(got), np_leaves(want))):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert g.tobytes() == w.tobytes(), f"leaf {i} differs from the call outside jit"


# ----------------------------------------------------- bitwise as outside jit

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "prod"])
def test_allreduce_inside_jit_is_the_call_outside(dtype, op, small_comm):
    """Sizes 0, 1, odd and past small_comm's 4 KiB fusion threshold, one fused call."""
    comm = small_comm
    if op == "average" and np.dtype(dtype).kind != "f" and np.dtype(dtype) != BF16:
        pytest.skip("average is for floating dtypes")
    x = tree_of(comm.rank, dtype, op, powers_of_two if op == "prod" else values)
    with collectively() as blk:
        inside = jax.jit(lambda t: gsj.allreduce(t, comm, op=op))(x)
        outside = gsj.allreduce(x, comm, op=op)
        same_bits(inside, outside)
        blk.same(np_leaves(inside))


def test_allreduce_inside_jit_against_numpy(comm):
    per_rank = [normal(r, (1001,), np.float64, "np") for r in range(comm.size)]
    with collectively():
        got = jax.jit(lambda a: gsj.allreduce(a, comm, op="average", prescale=0.5,
                                              postscale=3.0))(jnp.asarray(per_rank[comm.rank]))
        want = reduce_reference(per_rank, "average", 0.5, 3.0)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("kw", [{"op": "adasum"}, {"op": "average", "wire": "bfloat16"},
                                {"op": "sum", "wire": "float8_e4m3"},
                                {"op": "average", "prescale": 0.5, "postscale": 3.0}],
                         ids=["adasum", "bf16-wire", "fp8-wire", "scales"])
def test_allreduce_variants_inside_jit(kw, small_comm):
    comm = small_comm
    x = {k: v.astype(jnp.float32) for k, v in tree_of(comm.rank, np.float32, "var", normal).items()
         if k != "a"}
    with collectively():
        same_bits(jax.jit(lambda t: gsj.allreduce(t, comm, **kw))(x), gsj.allreduce(x, comm, **kw))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_inside_jit(dtype, small_comm):
    comm = small_comm
    root = comm.size - 1
    x = tree_of(comm.rank, dtype, "jbcast")
    with collectively():
        got = jax.jit(lambda t: gsj.broadcast(t, comm, root=root))(x)
        same_bits(got, tree_of(root, dtype, "jbcast"))


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int8, np.int64],
                         ids=lambda d: np.dtype(d).name)
def test_allgather_inside_jit(dtype, small_comm):
    comm = small_comm
    x = [jnp.asarray(values(comm.rank, s, dtype, ("jag", i)))
         for i, s in enumerate([(0, 3), (1,), (7, 3), (1500,)])]
    with collectively():
        same_bits(jax.jit(lambda t: gsj.allgather(t, comm))(x), gsj.allgather(x, comm))


@pytest.mark.parametrize("rows", [0, 1, 7, 1200])
def test_reduce_scatter_inside_jit(rows, small_comm):
    comm = small_comm
    x = {"a": jnp.asarray(values(comm.rank, (rows, 2), np.float32, "jrs")),
         "b": jnp.asarray(values(comm.rank, (rows,), np.int32, "jrs"))}
    with collectively():
        same_bits(jax.jit(lambda t: gsj.reduce_scatter(t, comm))(x),
                  gsj.reduce_scatter(x, comm))


def _alltoall_reference(tag, rank, size, shapes, dtype):
    """Block `rank` of dim 0 of every rank's arrays, in rank order: what
    alltoall gives `rank` (NumPy, from the values each rank makes)."""
    out = []
    for i, shape in enumerate(shapes):
        b = shape[0] // size
        out.append(np.concatenate([values(s, shape, dtype, (tag, i))[rank * b:(rank + 1) * b]
                                   for s in range(size)]))
    return out


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int8, np.int64],
                         ids=lambda d: np.dtype(d).name)
def test_alltoall_inside_jit_against_numpy(dtype, small_comm):
    """Block r of dim 0 to rank r, inside jit and outside, rows of 0, 1, 7
    and 1500 per rank (past the fusion of small calls), as NumPy says."""
    comm, p = small_comm, small_comm.size
    shapes = [(0, 3), (p,), (7 * p, 3), (1500 * p,)]
    x = [jnp.asarray(values(comm.rank, s, dtype, ("ja2a", i))) for i, s in enumerate(shapes)]
    want = _alltoall_reference("ja2a", comm.rank, p, shapes, dtype)
    with collectively():
        inside = jax.jit(lambda t: gsj.alltoall(t, comm))(x)
        outside = gsj.alltoall(x, comm)
        for got in (inside, outside):
            for g, w in zip(np_leaves(got), want):
                assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def test_alltoall_grad_vmap_and_its_errors(comm):
    """jax.grad through alltoall is the alltoall of the cotangents (the
    permutation is its own transpose); under vmap the blocks come from dim 0
    of the unbatched arrays; a dim 0 the rank count does not divide is a
    ValueError naming the leaf, before any rank communicates."""
    p, r = comm.size, comm.rank
    ws = [normal(s, (2 * p, 3), np.float64, "a2aw") for s in range(p)]

    def loss(x):
        return jnp.sum(jnp.asarray(ws[r]) * gsj.alltoall(x, comm))

    x = jnp.asarray(normal(r, (2 * p, 3), np.float64, "a2ax"))
    with collectively():
        got = np.asarray(jax.jit(jax.grad(loss))(x))
        # d loss / d x[block s] = block r of... rank s's weights at block r
        want = np.concatenate([ws[s][2 * r:2 * r + 2] for s in range(p)])
        np.testing.assert_array_equal(got, want)
        batch = jnp.asarray(values(r, (3, 2 * p, 2), np.float32, "a2av"))
        moved = np.asarray(jax.jit(jax.vmap(lambda a: gsj.alltoall(a, comm)))(batch))
        each = [values(s, (3, 2 * p, 2), np.float32, "a2av") for s in range(p)]
        ref = np.stack([np.concatenate([e[b][2 * r:2 * r + 2] for e in each]) for b in range(3)])
        assert np.array_equal(moved, ref)
        odd = jnp.ones(2 * p + 1) if p > 1 else jnp.float32(1)  # at 1 rank: a scalar
        with pytest.raises(ValueError, match=r"x\['odd'\] has shape \((\d+,)?\): dim 0 must"):
            jax.jit(lambda t: gsj.alltoall(t, comm))({"odd": odd})
    comm.barrier()  # nothing was sent: still usable


def test_a_pytree_is_one_fused_call(small_comm):
    """Ten gradients, one collective call and one validation, inside jit as outside."""
    comm = small_comm
    grads = {f"g{i}": jnp.full((i * 100 + 1,), float(comm.rank), jnp.float32)
             for i in range(10)}
    f = jax.jit(lambda t: gsj.allreduce(t, comm))
    jax.block_until_ready(f(grads))  # compiled, run once
    with collectively():
        before = comm.stats()
        out = jax.block_until_ready(f(grads))
        after = comm.stats()
        assert after["calls"] - before["calls"] == 1
        assert after["validations"] - before["validations"] == 1
        total = sum(range(comm.size))
        assert all(np.all(np.asarray(v) == total) for v in out.values())


def test_calls_keep_program_order(comm):
    """Three independent collectives of different sizes in one program: XLA
    may not reorder them (the ordered effect's token chains them), so every
    rank makes them in the order written."""
    @jax.jit
    def three(a, b, c):
        return (gsj.allreduce(a, comm), gsj.broadcast(b, comm, root=0),
                gsj.allreduce(c, comm, op="max"))
    a, b, c = jnp.ones(5), jnp.full(7, float(comm.rank)), jnp.arange(3.0) + comm.rank
    with collectively():
        ra, rb, rc = three(a, b, c)
        assert np.array_equal(np.asarray(ra), np.full(5, comm.size))
        assert np.array_equal(np.asarray(rb), np.zeros(7))
        assert np.array_equal(np.asarray(rc), np.arange(3.0) + comm.size - 1)


# -------------------------------------------------------------------- grad

def test_grad_through_allreduce_is_the_analytic_gradient(comm):
    """Rank r's loss sum(w_r * y**2), y = pre * post * sum_s x_s / size:
    the gradient on rank r is the allreduce of the cotangents,
    2 * (pre * post / size) * sum_s w_s * y."""
    pre, post = 0.5, 3.0
    xs = [normal(s, (9,), np.float64, "gx") for s in range(comm.size)]
    ws = [normal(s, (9,), np.float64, "gw") for s in range(comm.size)]
    w = jnp.asarray(ws[comm.rank])

    def loss(x):
        y = gsj.allreduce(x, comm, op="average", prescale=pre, postscale=post)
        return jnp.sum(w * y ** 2)

    with collectively():
        got = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(xs[comm.rank])))
        c = pre * post / comm.size
        y = c * np.sum(xs, axis=0)
        np.testing.assert_allclose(got, 2 * c * np.sum(ws, axis=0) * y, rtol=1e-13)
        eager = np.asarray(jax.grad(loss)(jnp.asarray(xs[comm.rank])))
        np.testing.assert_allclose(eager, got, rtol=1e-15)


def test_grad_through_broadcast_allgather_reduce_scatter(comm):
    n, size, rank = 2 * comm.size, comm.size, comm.rank
    xs = [normal(s, (n,), np.float64, "gx2") for s in range(size)]
    ws = [normal(s, (n,), np.float64, "gw2") for s in range(size)]
    wg = [normal(s, (n * size,), np.float64, "gw3") for s in range(size)]
    x = jnp.asarray(xs[rank])

    def loss(x):
        b = gsj.broadcast(x, comm, root=0)
        g = gsj.allgather(x, comm)
        r = gsj.reduce_scatter(x * x, comm, op="sum")
        return (jnp.sum(jnp.asarray(ws[rank]) * b) + jnp.sum(jnp.asarray(wg[rank]) * g)
                + jnp.sum(r))

    with collectively():
        got = np.asarray(jax.jit(jax.grad(loss))(x))
        # broadcast: root gets sum_s w_s; allgather: sum_s of my block of wg_s;
        # reduce_scatter of x*x, cotangent 1 everywhere: 2 x (allgather of ones)
        want = (np.sum(ws, axis=0) if rank == 0 else 0) + \
            np.sum([w[rank * n:(rank + 1) * n] for w in wg], axis=0) + 2 * xs[rank]
        np.testing.assert_allclose(got, want, rtol=1e-13)


def test_grad_through_allreduce_under_scan_and_vmap(comm):
    """y_{k+1} = allreduce(y_k) * w_r, three times under lax.scan, loss sum(y_3):
    the transposes run in reverse order on every rank, and the gradient is the
    analytic one; vmap over a batch of x gives each row's."""
    size = comm.size
    ws = [1.0 + 0.25 * s for s in range(size)]
    w = ws[comm.rank]

    def loss(x):
        def body(y, _):
            return gsj.allreduce(y, comm) * w, None
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

    # backwards, each round's allreduce transposes to a sum over ranks of the
    # cotangents w_s * (what came before): W, W**2, W**3 with W = sum_s w_s
    want = sum(ws) ** 3
    x = jnp.arange(6.0).reshape(2, 3)
    with collectively():
        got = np.asarray(jax.jit(jax.grad(loss))(x))
        np.testing.assert_allclose(got, np.full((2, 3), want), rtol=1e-14)
        rows = np.asarray(jax.jit(jax.vmap(jax.grad(loss)))(x))
        np.testing.assert_allclose(rows, np.full((2, 3), want), rtol=1e-14)


def test_grad_through_max_says_why(comm):
    with collectively():
        with pytest.raises(TypeError, match="sum' or 'average"):
            jax.grad(lambda x: jnp.sum(gsj.allreduce(x, comm, op="max")))(jnp.ones(3))


# ---------------------------------------------------------------- vmap

def test_vmap_batches_the_leading_axis(comm):
    x = jnp.asarray(values(comm.rank, (4, 3, 5), np.float32, "vm"))
    with collectively():
        same_bits(jax.jit(jax.vmap(lambda a: gsj.allreduce(a, comm)))(x), gsj.allreduce(x, comm))
        moved = jax.vmap(lambda a: gsj.allreduce(a, comm), in_axes=1, out_axes=1)(x)
        same_bits(moved, gsj.allreduce(x, comm))
        gathered = jax.vmap(lambda a: gsj.allgather(a, comm))(x)
        want = np.stack([np.concatenate([values(r, (4, 3, 5), np.float32, "vm")[b]
                                         for r in range(comm.size)]) for b in range(4)])
        assert np.array_equal(np.asarray(gathered), want)


# ------------------------------------------------------- scan, cond, training

def test_cond_takes_the_collective_on_every_rank(comm):
    @jax.jit
    def f(flag, x):
        return jax.lax.cond(flag, lambda v: gsj.allreduce(v, comm), lambda v: v * 2, x)
    x = jnp.arange(4.0)
    with collectively():
        assert np.array_equal(np.asarray(f(True, x)), np.arange(4.0) * comm.size)
        assert np.array_equal(np.asarray(f(False, x)), np.arange(4.0) * 2)


def _init(seed, sizes):
    rng = np.random.default_rng(seed)
    return [{"w": jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m)),
             "b": jnp.zeros((n,))} for m, n in zip(sizes[:-1], sizes[1:])]


def _loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def test_jitted_training_under_scan_equals_the_unjitted_loop(comm):
    """Ten micro-steps (grad, one fused allreduce of the gradient pytree,
    SGD) as one jitted lax.scan equal the same loop run op by op with the
    allreduce outside jit, and the single process on the whole batch."""
    sizes, per_rank, steps = [5, 16, 8, 3], 4, 10
    rng = np.random.default_rng(seed_for("jit-train"))
    n = per_rank * comm.size
    xs = rng.standard_normal((steps, n, 5))
    ys = np.tanh(xs @ rng.standard_normal((5, 3)))
    mine = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    params0 = _init(7, sizes)

    def step(p, batch):
        g = jax.grad(_loss)(p, *batch)
        g = gsj.allreduce(g, comm, op="average")
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), None

    @jax.jit
    def train(p, bx, by):
        return jax.lax.scan(step, p, (bx, by))[0]

    with collectively() as blk:
        got = train(params0, jnp.asarray(xs[:, mine]), jnp.asarray(ys[:, mine]))
        loop, whole = params0, params0
        for k in range(steps):
            loop = step(loop, (jnp.asarray(xs[k, mine]), jnp.asarray(ys[k, mine])))[0]
            g = jax.grad(_loss)(whole, jnp.asarray(xs[k]), jnp.asarray(ys[k]))
            whole = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, whole, g)
        for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (got, loop, whole))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-11, atol=1e-12)
        assert float(_loss(got, jnp.asarray(xs[0]), jnp.asarray(ys[0]))) < \
            float(_loss(params0, jnp.asarray(xs[0]), jnp.asarray(ys[0])))
        blk.same([np.asarray(p) for p in jax.tree_util.tree_leaves(got)])


# ------------------------------------------------------------------ errors

@pytest.mark.skipif(WORLD.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("kind", ["allreduce", "allgather"])
def test_shape_mismatch_raises_on_every_rank(kind, comm):
    n = 5 if comm.rank == 0 else 6
    f = gsj.checked(jax.jit(lambda a: getattr(gsj, kind)(a, comm)))
    with collectively():
        with pytest.raises(gs.MismatchError, match=kind) as ei:
            f(jnp.ones(n))
        assert isinstance(ei.value.__cause__, jax.errors.JaxRuntimeError)
    comm.barrier()  # still usable


@pytest.mark.skipif(WORLD.size < 2, reason="needs two ranks")
def test_a_mismatch_inside_jit_is_in_the_flight_record():
    """The handlers call the C entry points, so the flight recorder sees a
    jitted call as any other: each rank dumps, and the doctor names the two
    shapes."""
    import shutil
    import tempfile

    from gradsync import doctor
    folder = WORLD.bcast(tempfile.mkdtemp(prefix="gs-flight-") if WORLD.rank == 0 else None)
    before = gs.flight_record_dir()
    gs.flight_record_dir(folder)
    try:
        comm = gs.Communicator()
        n = 5 if comm.rank == 0 else 6
        with pytest.raises(gs.MismatchError) as ei:
            gsj.checked(jax.jit(lambda a: gsj.allreduce(a, comm)))(jnp.ones(n, jnp.float32))
        comm.close()
        WORLD.Barrier()
        rep = doctor.diagnose(folder) if WORLD.rank == 0 else None
        code, verdict = WORLD.bcast((rep.code, rep.verdict) if rep else None)
        with collectively():
            assert "allreduce inside jax.jit" in str(ei.value)
            assert code == doctor.MISMATCH, verdict
            assert "allreduce float32[5] sum" in verdict and "float32[6]" in verdict, verdict
    finally:
        gs.flight_record_dir(before)
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(WORLD.size < 2, reason="needs two ranks")
def test_a_stopped_rank_times_out_inside_jit(capfd):
    """test_faults.py's stopped rank, inside jit: the others' jitted
    allreduce raises gs.TimeoutError naming the operation (gsj.checked), and
    the communicator is unusable afterwards. The late rank calls only after
    every other rank has given up (marker files), never after a sleep."""
    import os
    import shutil
    import tempfile
    import time
    late = WORLD.size - 1
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None)
    comm = gs.Communicator(stall_seconds=0)
    f = gsj.checked(jax.jit(lambda a: gsj.allreduce(a, comm)))
    gs.set_timeout(0.5)
    raised = None
    try:
        if WORLD.rank == late:
            deadline = time.monotonic() + 60
            while len(os.listdir(folder)) < late and time.monotonic() < deadline:
                time.sleep(0.02)
        try:
            f(jnp.ones(1000))
        except gs.Error as exc:
            raised = exc
        if WORLD.rank != late:
            open(os.path.join(folder, f"gave_up.{WORLD.rank}"), "w").close()
        gs.set_timeout(0)
        with collectively():
            if WORLD.rank != late:
                assert isinstance(raised, gs.TimeoutError), repr(raised)
                assert "allreduce inside jax.jit" in str(raised)
                # its own limit, or a peer's notice that it ran out first
                assert ("GRADSYNC_TIMEOUT_SECONDS" in str(raised)
                        or "took longer than its timeout" in str(raised)), str(raised)
            with pytest.raises(gs.Error, match="unusable"):
                f(jnp.ones(3))
    finally:
        gs.set_timeout(0)
        comm.close()
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    # closing the broken communicator says so, once (read here, not left for the log)
    assert "freeing a communicator abandoned" in capfd.readouterr().err


def test_a_dtype_gradsync_lacks_is_named_at_trace_time(comm):
    with collectively():
        with pytest.raises(TypeError, match=r"x\['w'\] has dtype int16"):
            jax.jit(lambda t: gsj.allreduce(t, comm))({"w": jnp.ones(3, jnp.int16)})


def test_kernels_still_refuse_tracers(comm):
    with collectively():
        with pytest.raises(TypeError, match=r"x\[0\] is a JAX tracer"):
            jax.jit(lambda a: gsj.scale([a], 2.0))(jnp.ones(3))


def test_unavailable_jit_says_why(comm, monkeypatch):
    from gradsync.jax import _jit
    monkeypatch.setattr(_jit, "UNAVAILABLE", "libgradsync_jax.so was not built")
    with collectively():
        with pytest.raises(TypeError, match="was not built"):
            jax.jit(lambda a: gsj.allreduce(a, comm))(jnp.ones(3))


def test_supported_versions():
    from gradsync.jax._version import version_problem
    assert version_problem(jax.__version__) is None
    assert version_problem("0.10.2") is None
    assert "0.5 up to" in version_problem("0.4.38")
    assert "found JAX 0.11.0" in version_problem("0.11.0")


def test_donated_buffers_are_reduced_in_place(comm):
    """Under donate_argnums XLA hands the argument's buffer to the call, which
    writes the result over it: the result lives where the argument was."""
    x = jnp.asarray(values(comm.rank, (4096,), np.float32, "donate"))
    where = x.unsafe_buffer_pointer()
    want = sum(values(r, (4096,), np.float32, "donate") for r in range(comm.size))
    f = jax.jit(lambda a: gsj.allreduce(a, comm), donate_argnums=0)
    with collectively():
        out = f(x)
        assert np.array_equal(np.asarray(out), want)
        assert out.unsafe_buffer_pointer() == where


def test_an_unsupported_jax_fails_at_import(comm):
    """import gradsync.jax under a JAX outside SUPPORTED_JAX (its version
    string replaced before the import, in a child process on rank 0)."""
    code = ("import jax; jax.__version__ = '0.4.30'\n"
            "try:\n    import gradsync.jax\nexcept ImportError as e:\n    print('refused:', e)\n")
    child = run_child(code, {"JAX_PLATFORMS": "cpu"}, timeout=300) if comm.rank == 0 else None
    with collectively():
        if comm.rank == 0:
            assert "refused: gradsync.jax supports JAX 0.5 up to (not including) 0.11, " \
                "found JAX 0.4.30" in child.stdout, (child.stdout, child.stderr)


def test_lowers_for_cuda_on_xla_stream(comm):
    """The CUDA lowering (no GPU here: its handler, GsJax*Cuda, runs on a GPU
    machine): the same custom call, its token and the result over its input."""
    f = jax.jit(lambda a: gsj.allreduce(a, comm, op="average"))
    text = f.trace(jnp.ones(3)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @gradsync_allreduce(" in text
    assert "!stablehlo.token" in text and "output_operand_alias" in text
    assert f"comm = {comm.c_handle} : i64" in text
