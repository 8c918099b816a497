"""comm.allreduce(..., op="adasum") against the float64 reference of
docs/GUIDE.md section 5 (adasum_reference.py).

Runs at any world size (1..8); tests that need a given size skip elsewhere.
Every rank regenerates every rank's inputs locally, so the reference needs no
communication.  Every rank makes the same sequence of collective calls and
every check that can fail locally is made collective.

Tolerances.  The reference can emulate the runtime's storage (``store``):
prescaled inputs, every intermediate vector of the tree and the postscaled
result rounded to the tensor's dtype.  Against that emulation the runtime may
still differ by about an ulp per rounding step (its dot products are summed
in another order, float16/bfloat16 take their scaled add in float32, a
rounding may fall the other way), relative to the largest magnitude the
tensor reaches in the tree.  float64 also gets 1e-12 for the dot products.
Cases whose exact answer is known from the contract (orthogonal inputs,
subnormals, identical inputs) are checked bitwise.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from adasum_reference import (
    adasum_reference,
    adasum_with_magnitude,
    largest_power_of_two,
    relative_l2_error,
    tree_levels,
)
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    BF16,
    FLOAT_DTYPES,
    INT_DTYPES,
    bits,
    check_unchanged,
    collective_assert,
    collectively,
    dtype_name,
    seed_for,
)

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
MSG_THRESHOLD = 256 * 1024  # the "message" communicator's fusion threshold


def eps(dt):
    return float(ml_dtypes.finfo(np.dtype(dt)).eps)


def finfo(dt):
    return ml_dtypes.finfo(np.dtype(dt))


@pytest.fixture(scope="module")
def msg_comm():
    """Fusion threshold 256 KiB: a tensor over it goes as its own message,
    the small ones around it are fused."""
    c = gs.Communicator(WORLD, fusion_threshold=MSG_THRESHOLD)
    yield c
    c.close()


def need_size(*sizes):
    if WORLD.size not in sizes:
        pytest.skip("needs %s ranks (running on %d)"
                    % (" or ".join(map(str, sizes)), WORLD.size))


# ---------------------------------------------------------------- checking

def tolerance_rel(dt, prescale=1.0, postscale=1.0, nranks=None, k=2.0):
    """Allowed |got - ref| relative to the tensor's magnitude in the tree:
    k ulps per rounding step (tree levels, prescale, postscale, store)."""
    p = WORLD.size if nranks is None else nranks
    steps = tree_levels(p) + 1 + (prescale != 1.0) + (postscale != 1.0)
    rel = k * steps * eps(dt)
    if np.dtype(dt) == F64:
        rel += 1e-12
    return rel


def references(per_rank, prescale=1.0, postscale=1.0):
    """[(reference, magnitude)] per tensor (storage-emulating, each tensor
    rounded at the same points as the runtime stores it)."""
    return [adasum_with_magnitude([r[i] for r in per_rank], prescale,
                                  postscale, store=per_rank[0][i].dtype)
            for i in range(len(per_rank[0]))]


def check_adasum(outs, per_rank, prescale=1.0, postscale=1.0, what="tensor",
                 k=2.0, refs=None):
    """Local check of a list of results: per_rank[r][i] is rank r's input
    tensor i.  Each tensor against the storage-emulating reference, with
    tolerance_rel * (largest magnitude of that tensor in the tree), plus a
    few of the dtype's smallest subnormals.  ``refs``: references(...) of
    the same inputs, computed once for several checks."""
    assert len(outs) == len(per_rank[0]), "%d results for %d tensors" % (
        len(outs), len(per_rank[0]))
    if refs is None:
        refs = references(per_rank, prescale, postscale)
    for i, o in enumerate(outs):
        x = per_rank[0][i]
        assert isinstance(o, np.ndarray), "%s %d: not an ndarray: %r" % (
            what, i, type(o))
        assert o.dtype == x.dtype and o.shape == x.shape, (
            "%s %d: %s %s, expected %s %s" % (what, i, o.dtype, o.shape,
                                               x.dtype, x.shape))
        if o.size == 0:
            continue
        dt = x.dtype
        ref, mag = refs[i]
        rel = tolerance_rel(dt, prescale, postscale, k=k)
        sub = float(finfo(dt).smallest_subnormal)
        tol = rel * mag + 8 * sub
        g = o.astype(np.float64)
        bad = ~(np.abs(g - ref) <= tol)
        if np.any(bad):
            idx = [tuple(ix) for ix in np.argwhere(bad)[:4]]
            samples = "; ".join("at %s got %r expected %r" % (
                ix, g[ix].item(), ref[ix].item()) for ix in idx)
            raise AssertionError(
                "%s %d (%s %s, %d ranks, prescale %g, postscale %g): %d of %d "
                "elements off by more than %g (= %g x magnitude %g); %s" % (
                    what, i, dt, o.shape, WORLD.size, prescale, postscale,
                    int(np.count_nonzero(bad)), o.size, tol, rel, mag,
                    samples))


def check_exact(outs, expected, what="tensor"):
    """Bitwise equality with expected values (float64, rounded to the
    result's dtype)."""
    for i, (o, e) in enumerate(zip(outs, expected)):
        want = np.asarray(e, dtype=np.float64).astype(o.dtype).reshape(o.shape)
        if bits(o).tobytes() != bits(want).tobytes():
            g = o.reshape(-1)
            w = want.reshape(-1)
            bad = [j for j in range(g.size)
                   if g[j:j + 1].tobytes() != w[j:j + 1].tobytes()]
            raise AssertionError(
                "%s %d (%s %s, %d ranks): %d element(s) not bitwise equal to "
                "the exact result; first: %s" % (
                    what, i, o.dtype, o.shape, WORLD.size, len(bad),
                    "; ".join("[%d] got %r expected %r" % (
                        j, float(g[j]), float(w[j])) for j in bad[:4])))


def reduce_on_all_ranks(comm, arrays, op="adasum", what="", **kw):
    """One out-of-place allreduce whose results must be bitwise identical on
    every rank (checked in the same exchange that makes failures collective)."""
    with collectively(what=what) as blk:
        out = comm.allreduce(arrays, op, **kw)
        blk.same(out)
    return out


def run_twice(comm, arrays, what="", **kw):
    """Out of place twice (same inputs): results bitwise identical from one
    call to the next and across ranks.  Returns the first results."""
    out1 = reduce_on_all_ranks(comm, arrays, what=what + " (call 1)", **kw)
    out2 = reduce_on_all_ranks(comm, arrays, what=what + " (call 2)", **kw)
    with collectively(what=what):
        for i, (a, b) in enumerate(zip(out1, out2)):
            assert bits(a).tobytes() == bits(b).tobytes(), (
                "tensor %d: second identical call gave different bytes" % i)
    return out1


# ---------------------------------------------------------------- exact cases

TWO_RANK_CASES = [
    ([1, 0], [0, 1], [1, 1]),
    ([1, 2], [2, 4], [1.5, 3]),
    ([0, 0], [3, 4], [3, 4]),
    ([1, 0], [-1, 0], [0, 0]),
    ([1, 1], [1, 0], [1.25, 0.75]),
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("case", range(len(TWO_RANK_CASES)),
                         ids=["orthogonal", "parallel", "zero", "opposite",
                              "angle45"])
def test_exact_two_ranks(case, dtype, comm):
    need_size(2)
    a, b, want = TWO_RANK_CASES[case]
    ref = adasum_reference([np.array(a, float), np.array(b, float)])
    collective_assert(np.array_equal(ref, want),
                      "reference gives %r, expected %r" % (ref, want))
    mine = np.array([a, b][comm.rank], dtype=dtype)
    with collectively() as blk:
        out = comm.allreduce(mine, "adasum")
        assert isinstance(out, np.ndarray)
        blk.same(out)
        check_exact([out], [want])
    with collectively() as blk:  # the same pair given the other way round
        other = np.array([b, a][comm.rank], dtype=dtype)
        out = comm.allreduce(other, op=gs.Op.ADASUM)
        blk.same(out)
        check_exact([out], [want])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_exact_four_ranks(dtype, comm):
    need_size(4)
    g = [[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 2]]
    want = np.array([4 / 3, 4 / 3, 5 / 3])
    ref = adasum_reference([np.array(v, float) for v in g])
    collective_assert(np.allclose(ref, want, rtol=0, atol=1e-15),
                      "reference gives %r" % (ref,))
    mine = np.array(g[comm.rank], dtype=dtype)
    with collectively() as blk:
        out = comm.allreduce_(mine.copy(), "adasum")
        blk.same(out)
        # level 1 is exact ([1,1,0] and [1,1,2]); level 2 has coefficients
        # 1/2 and 5/6: one rounding of 4/3 and 5/3 to the dtype, at most one
        # ulp away when done in float32 for the 16-bit dtypes.
        got = out.astype(np.float64)
        tol = 2 * eps(dtype) * 2
        assert np.all(np.abs(got - want) <= tol), (
            "got %r expected %r (tol %g)" % (got, want, tol))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_onnxruntime_vectors(dtype, comm):
    """ONNX Runtime's Adasum test vectors (2 ranks)."""
    need_size(2)
    x, y = [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]
    want = np.array([5.6301, 6.5235, 7.4169])
    atol = max(1e-4, 2 * eps(dtype) * 8)
    mine = [np.array(x, dtype), np.array(y, dtype)] if comm.rank == 0 else \
        [np.array(y, dtype), np.array(x, dtype)]
    with collectively() as blk:
        out = comm.allreduce(mine, "adasum")
        assert isinstance(out, list) and len(out) == 2
        blk.same(out)
        for o in out:
            assert np.allclose(o.astype(np.float64), want, rtol=0,
                               atol=atol), "got %r expected %r" % (o, want)
        # both tensors are the same pair, so the same bytes
        assert bits(out[0]).tobytes() == bits(out[1]).tobytes()
    # one tensor whose halves go to different ranks in the halving
    mine = np.array([[4, 5, 6, 7], [8, 9, 10, 11]][comm.rank], dtype)
    want = np.array([6.2643, 7.1228, 7.9812, 8.8397])
    atol = max(1e-4, 2 * eps(dtype) * 12)
    with collectively() as blk:
        out = comm.allreduce(mine, "adasum")
        blk.same(out)
        assert np.allclose(out.astype(np.float64), want, rtol=0, atol=atol), (
            "got %r expected %r" % (out, want))


# ---------------------------------------------------------------- Horovod's

def horovod_sizes(dtype):
    p = WORLD.size
    sizes = [p * 20 - 17, p * 2 + 1, p + 2]
    if np.dtype(dtype) in (F32, F64):
        sizes.append(2 ** 19)
    return sizes


HOROVOD_DTYPES = FLOAT_DTYPES


@pytest.mark.parametrize("dtype", HOROVOD_DTYPES, ids=dtype_name)
def test_horovod_orthogonal(dtype, comm):
    """Each rank nonzero on its own coordinates (i % size == rank): every dot
    product is 0, every coefficient exactly 1, so the result is exactly the
    sum (one nonzero per element): bitwise."""
    p, me = WORLD.size, comm.rank
    sizes = horovod_sizes(dtype)
    per_rank = []
    for r in range(p):
        rng = np.random.default_rng(seed_for("orth", dtype.name, r))
        ts = []
        for n in sizes:
            t = np.zeros(n, dtype)
            idx = np.arange(r, n, p)
            t[idx] = (rng.uniform(0.5, 2.0, idx.size)
                      * rng.choice([-1.0, 1.0], idx.size)).astype(dtype)
            ts.append(t)
        per_rank.append(ts)
    want = [np.sum([per_rank[r][i].astype(np.float64) for r in range(p)],
                   axis=0) for i in range(len(sizes))]
    for i in range(len(sizes)):
        ref = adasum_reference([pr[i] for pr in per_rank])
        collective_assert(np.array_equal(ref, want[i]),
                          "reference is not the sum for tensor %d" % i)
    out = run_twice(comm, per_rank[me], "orthogonal")
    with collectively():
        check_exact(out, want)


@pytest.mark.parametrize("dtype", HOROVOD_DTYPES, ids=dtype_name)
def test_horovod_parallel_identical(dtype, comm):
    """The same tensors on every rank: the result is that tensor."""
    sizes = horovod_sizes(dtype)
    rng = np.random.default_rng(seed_for("par", dtype.name))
    ts = [rng.uniform(-3, 3, n).astype(dtype) for n in sizes]
    refs = references([ts] * WORLD.size)
    collective_assert(all(np.array_equal(r, t.astype(np.float64))
                          for (r, _), t in zip(refs, ts)),
                      "reference of identical inputs is not the input")
    out = run_twice(comm, [t.copy() for t in ts], "identical")
    with collectively():
        check_adasum(out, [ts] * WORLD.size, refs=refs)
        for i, (o, t) in enumerate(zip(out, ts)):
            err = relative_l2_error(o, t)
            assert err < 100 * eps(dtype), (
                "tensor %d: relative L2 error %g vs the input" % (i, err))


@pytest.mark.parametrize("dtype", HOROVOD_DTYPES, ids=dtype_name)
def test_horovod_parallel_scaled(dtype, comm):
    """All ranks hold s_r * v with positive per-rank scales: for two parallel
    vectors adasum(s1 v, s2 v) = (s1 + s2)/2 v, so a power-of-two tree gives
    the mean scale; the non-power-of-two fold weights ranks unequally.  The
    reference says which."""
    p = WORLD.size
    sizes = horovod_sizes(dtype)
    rng = np.random.default_rng(seed_for("pars", dtype.name))
    vs = [rng.uniform(-2, 2, n) for n in sizes]
    scales = [0.25 * (r + 1) ** 1.5 for r in range(p)]
    per_rank = [[(s * v).astype(dtype) for v in vs] for s in scales]
    refs = references(per_rank)
    if p == largest_power_of_two(p):
        mean = sum(scales) / p
        for (ref, _), v in zip(refs, vs):
            err = relative_l2_error(ref, mean * v)
            collective_assert(err < 1000 * eps(dtype),
                              "reference %g away from the mean scale" % err)
    out = run_twice(comm, per_rank[comm.rank], "parallel scaled")
    with collectively():
        check_adasum(out, per_rank, refs=refs)
        for i, (o, (ref, _)) in enumerate(zip(out, refs)):
            err = relative_l2_error(o, ref)
            assert err < 100 * eps(dtype), (
                "tensor %d: relative L2 error %g" % (i, err))


@pytest.mark.parametrize("dtype", HOROVOD_DTYPES, ids=dtype_name)
def test_horovod_near_smallest_normal(dtype, comm):
    """Identical inputs near the dtype's smallest normal.  float16, bfloat16
    and float32: the squared norms stay above sqrt(DBL_MIN) in float64, so the
    result is the input (the average).  float64: every product underflows,
    A < sqrt(DBL_MIN), every coefficient is 1 and the result is the sum of the
    ranks' inputs: the reference says so and the runtime must agree."""
    p = WORLD.size
    sizes = horovod_sizes(dtype)
    tiny = float(finfo(dtype).tiny)
    rng = np.random.default_rng(seed_for("tiny", dtype.name))
    ts = [(tiny * rng.uniform(1.0, 1.9, n)).astype(dtype) for n in sizes]
    refs_mag = references([ts] * p)
    refs = [r for r, _ in refs_mag]
    if dtype == F64:
        want = [t.astype(np.float64) * p for t in ts]
        ok = all(np.allclose(r, w, rtol=4 * eps(dtype), atol=0)
                 for r, w in zip(refs, want))
        collective_assert(ok, "float64 reference is not the sum")
    else:
        ok = all(np.array_equal(r, t.astype(np.float64))
                 for r, t in zip(refs, ts))
        collective_assert(ok, "reference is not the input")
    out = run_twice(comm, [t.copy() for t in ts], "near tiny")
    with collectively():
        check_adasum(out, [ts] * p, refs=refs_mag)
        for i, (o, r) in enumerate(zip(out, refs)):
            err = relative_l2_error(o, r)
            assert err < 100 * eps(dtype), (
                "tensor %d: relative L2 error %g vs the reference (%s)" % (
                    i, err, "sum" if dtype == F64 else "the input"))


STABILITY = [pytest.param(dt, "full", id=dt.name) for dt in HOROVOD_DTYPES]
STABILITY.append(pytest.param(BF16, "ratio1e30", id="bfloat16-ratio1e30"))


@pytest.mark.parametrize("dtype,span", STABILITY)
def test_horovod_stability(dtype, span, comm):
    """One direction v on every rank, per-rank scales spread geometrically
    from the dtype's smallest normal to sqrt(its max) (for float64 kept low
    enough that <a,a> stays finite): coefficients reach |1 - s2/(2 s1)| of
    1e6 (float16) to 1e57 (float32, bfloat16: beyond float32's range) and the
    scaled add cancels.  Relative L2 error below 100 eps against the
    reference.  "ratio1e30": bfloat16 with scales at most 1e30 apart, so
    every coefficient also fits a float32."""
    p = WORLD.size
    sizes = horovod_sizes(dtype)
    fi = finfo(dtype)
    rng = np.random.default_rng(seed_for("stab", dtype.name))
    vs = [rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n)
          for n in sizes]
    lo = math.log(float(fi.tiny))
    per_rank = [[] for _ in range(p)]
    for v in vs:
        top = math.sqrt(float(fi.max))
        if dtype == F64:
            top = math.sqrt(float(fi.max) / (8.0 * float(np.dot(v, v))))
        hi = math.log(top)
        if span == "ratio1e30":
            lo = math.log(1e-15)
            hi = math.log(1e15)
        for r in range(p):
            s = math.exp(lo + (hi - lo) * (r / (p - 1) if p > 1 else 1.0))
            per_rank[r].append((s * v).astype(dtype))
    refs = [adasum_reference([pr[i] for pr in per_rank], store=dtype)
            for i in range(len(sizes))]
    collective_assert(all(np.all(np.isfinite(r)) for r in refs),
                      "reference not finite")
    out = run_twice(comm, per_rank[comm.rank], "stability")
    with collectively():
        for i, (o, ref) in enumerate(zip(out, refs)):
            err = relative_l2_error(o, ref)
            assert np.all(np.isfinite(o.astype(np.float64))), (
                "tensor %d: non-finite results" % i)
            assert err < 100 * eps(dtype), (
                "tensor %d (%d elements): relative L2 error %g >= 100 eps "
                "(%g)" % (i, o.size, err, 100 * eps(dtype)))


# ---------------------------------------------------------------- random data

def random_layout(dtype, big):
    """Sizes 0, 1, odd, a 2-D one, and (big) one over 256 KiB."""
    shapes = [(0,), (1,), (3,), (17,), (5, 7), (2, 0), (129,), (1001,)]
    if big:
        shapes.insert(4, (MSG_THRESHOLD // np.dtype(dtype).itemsize + 37,))
    return shapes


def random_inputs(inputs, shapes, dtype):
    """Random normal inputs, plus: tensor 2 is zero on rank 0 (A = 0, its
    coefficient is 1), tensor 3 scaled by 2**rank (unequal norms), the last
    tensor identical on ranks 0 and 1 (parallel pair)."""
    per_rank = inputs.all_ranks(shapes, dtype)
    for r, ts in enumerate(per_rank):
        if r == 0:
            ts[2][...] = 0
        ts[3][...] = (ts[3].astype(np.float64) * 2.0 ** r).astype(dtype)
        if r == 1:
            ts[-1][...] = per_rank[0][-1]
    return per_rank


SCALES = [
    pytest.param(1.0, 1.0, "default", id="noscale-default"),
    pytest.param(1.0, 1.0, "msg256k", id="noscale-msg256k"),
    pytest.param(0.5, 1.0, "default", id="pre-default"),
    pytest.param(1.0, 0.25, "default", id="post-default"),
    pytest.param(-3.0, 0.1, "msg256k", id="prepost-msg256k"),
]


@pytest.mark.parametrize("prescale,postscale,which", SCALES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_random_against_reference(dtype, prescale, postscale, which, comm,
                                  msg_comm, inputs):
    """Fused lists (sizes 0, 1, odd, 2-D; with the 256 KiB threshold also
    one tensor over it, which goes as its own message), out of place (twice:
    bitwise the same) and in place (bitwise the same as out of place),
    against the reference; identical on all ranks."""
    c = msg_comm if which == "msg256k" else comm
    big = which == "msg256k"
    shapes = random_layout(dtype, big)
    per_rank = random_inputs(inputs, shapes, dtype)
    mine = [a.copy() for a in per_rank[c.rank]]
    copies = [a.copy() for a in mine]
    kw = dict(prescale=prescale, postscale=postscale)
    refs = references(per_rank, prescale, postscale)
    out = run_twice(c, mine, "out of place", **kw)
    with collectively(what="out of place"):
        check_unchanged(mine, copies)
        for o, a in zip(out, mine):
            assert o.size == 0 or not np.shares_memory(o, a)
        check_adasum(out, per_rank, prescale, postscale, refs=refs)
    with collectively(what="in place") as blk:
        res = c.allreduce_(mine, "adasum", **kw)
        assert res is mine, "in-place call must return its inputs"
        blk.same(mine)
        check_adasum(mine, per_rank, prescale, postscale, refs=refs)
        for i, (a, o) in enumerate(zip(mine, out)):
            assert bits(a).tobytes() == bits(o).tobytes(), (
                "tensor %d: in place differs from out of place" % i)


def test_mixed_dtypes_in_one_list(comm, small_comm, inputs):
    """One call with all four float dtypes interleaved: per tensor, each in
    its dtype; with the 4 KiB threshold too."""
    shapes = [(33,), (7, 3), (1,), (300,), (0,), (2049,), (5,), (64,)]
    dts = [F16, F32, BF16, F64, F32, F16, BF16, F64]
    per_rank = [inputs.arrays(r, shapes, dts) for r in range(WORLD.size)]
    for c in (comm, small_comm):
        out = run_twice(c, [a.copy() for a in per_rank[c.rank]], "mixed")
        with collectively():
            check_adasum(out, per_rank)


def test_dot_products_are_per_tensor(comm, inputs):
    """Two tensors fused in one call agree with each alone and with the
    per-tensor reference, and differ from Adasum of their concatenation when
    P > 1.  (Not bitwise: the halving splits the fused buffer, not each
    tensor, so the partial dot products are summed in another grouping.)"""
    shapes = [(40,), (23,)]
    per_rank = inputs.all_ranks(shapes, F64)
    mine = per_rank[comm.rank]
    fused = reduce_on_all_ranks(comm, mine)
    with collectively():
        alone0 = comm.allreduce(mine[0], "adasum")
    with collectively():
        alone1 = comm.allreduce(mine[1], "adasum")
        check_adasum(fused, per_rank, what="fused tensor")
        check_adasum([alone0, alone1], per_rank, what="tensor alone")
        for f, a in zip(fused, (alone0, alone1)):
            assert np.allclose(f, a, rtol=1e-13, atol=0), (
                "fused %r vs alone %r" % (f[:4], a[:4]))
        if WORLD.size > 1:
            cat = adasum_reference([np.concatenate(t) for t in per_rank])
            got = np.concatenate(fused)
            assert not np.allclose(got, cat, rtol=1e-6, atol=0), (
                "result matches Adasum over the concatenated buffer")


def test_single_rank_is_identity_and_enum(comm, inputs):
    """Op.ADASUM and "adasum" give the same bytes; with one rank the result
    is the input (times prescale*postscale)."""
    shapes = [(9,), (4, 4)]
    per_rank = inputs.all_ranks(shapes, F32)
    mine = per_rank[comm.rank]
    a = reduce_on_all_ranks(comm, mine)
    with collectively():
        b = comm.allreduce(mine, gs.Op.ADASUM)
        for x, y in zip(a, b):
            assert bits(x).tobytes() == bits(y).tobytes()
        if WORLD.size == 1:
            check_exact(a, mine)


# ---------------------------------------------------------------- subnormals

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_subnormal_on_one_rank_kept(dtype, comm):
    """A subnormal on one rank, zeros elsewhere: coefficient 1 (the others'
    norms are 0; its own squared norm is >= sqrt(DBL_MIN) except in float64,
    where it underflows to 0: coefficient 1 as well), so the result is that
    subnormal exactly.  No flush to zero."""
    fi = finfo(dtype)
    sub = float(fi.smallest_subnormal)
    vals = [sub, 3 * sub, float(fi.tiny) / 2]
    if dtype in (F32, BF16):
        vals.append(1e-40)
    p, me = WORLD.size, comm.rank
    n = 4 * len(vals)
    per_rank = []
    for r in range(p):
        t = np.zeros(n, dtype)
        if r == p - 1:
            t[:len(vals)] = np.array(vals).astype(dtype)
        per_rank.append([t])
    want = per_rank[p - 1][0].astype(np.float64)
    collective_assert(np.all(want[:len(vals)] != 0), "values flushed by NumPy")
    ref = adasum_reference([pr[0] for pr in per_rank], store=dtype)
    collective_assert(np.array_equal(ref, want),
                      "reference %r != %r" % (ref, want))
    out = run_twice(comm, per_rank[me], "subnormal")
    with collectively():
        check_exact(out, [want])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_subnormal_identical_on_all_ranks(dtype, comm):
    """The same subnormals on every rank.  float16/bfloat16/float32: A >=
    sqrt(DBL_MIN), coefficients 1/2, 0.5a + 0.5a = a exactly.  float64: the
    squares underflow, coefficients 1, the result is the (exact) sum P*a."""
    fi = finfo(dtype)
    sub = float(fi.smallest_subnormal)
    t = np.array([sub * 2, sub * 6, sub * 10, 0.0, -sub * 2]).astype(dtype)
    p = WORLD.size
    ref = adasum_reference([t] * p, store=dtype)
    want = t.astype(np.float64) * (p if dtype == F64 else 1)
    collective_assert(np.array_equal(ref, want),
                      "reference %r != %r" % (ref, want))
    out = run_twice(comm, [t.copy()], "subnormal identical")
    with collectively():
        check_exact(out, [want])


@pytest.mark.parametrize("scale,rule", [(1e-80, "sum"), (1e-70, "average")])
def test_norm_threshold_float64(scale, rule, comm):
    """The coefficient rule's threshold is sqrt(DBL_MIN) ~ 1.5e-154, not 0:
    identical float64 inputs of size 1e-80 (squared norms ~1e-160, nonzero
    but below it at every tree level) take coefficient 1, so the result is
    the sum P*x; inputs of size 1e-70 (squared norms ~1e-140) give the
    average, x itself."""
    p = WORLD.size
    x = np.array([1.0, -2.0, 0.5, 3.0, -1.25]) * scale
    ref = adasum_reference([x] * p)
    want = x * (p if rule == "sum" else 1)
    collective_assert(np.allclose(ref, want, rtol=1e-15, atol=0),
                      "reference %r != %r" % (ref, want))
    out = run_twice(comm, [x.copy()], "threshold")
    with collectively():
        got = out[0]
        assert np.allclose(got, want, rtol=4e-16 * 4, atol=0), (
            "%d ranks, x = %r: got %r, expected %r (the %s; A = %g vs "
            "sqrt(DBL_MIN) = %g)" % (p, x, got, want, rule,
                                     float(np.dot(x, x)), 1.49e-154))


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("inplace", [False, True],
                         ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=dtype_name)
def test_integer_dtypes_raise_typeerror(dtype, inplace, comm):
    x = [np.arange(5, dtype=dtype), np.ones((3, 2), dtype=dtype)]
    copies = [a.copy() for a in x]
    fn = comm.allreduce_ if inplace else comm.allreduce
    with collectively():
        with pytest.raises(TypeError) as ei:
            fn(x, "adasum")
        assert isinstance(ei.value, gs.DtypeError), repr(ei.value)
        check_unchanged(x, copies)
    # a float tensor before the integer one: the whole call is refused
    y = [np.ones(4, np.float32), np.arange(3, dtype=dtype)]
    ycopies = [a.copy() for a in y]
    with collectively():
        with pytest.raises(TypeError):
            fn(y, gs.Op.ADASUM)
        check_unchanged(y, ycopies)
    # the communicator still works afterwards
    with collectively() as blk:
        out = comm.allreduce([np.ones(3, np.float64)], "adasum")
        blk.same(out)
        assert np.array_equal(out[0], np.ones(3))


@pytest.mark.parametrize("op", ["adasum", gs.Op.ADASUM], ids=["str", "enum"])
def test_adasum_only_for_allreduce(op, comm):
    """reduce_scatter and reduce_scatter_shards_ refuse op adasum
    (ValueError or TypeError, on every rank); nothing is written."""
    x = [np.arange(2 * WORLD.size + 1, dtype=np.float32)]
    copies = [a.copy() for a in x]
    with collectively(what="reduce_scatter"):
        with pytest.raises((ValueError, TypeError)):
            comm.reduce_scatter(x, op)
        check_unchanged(x, copies)
    with collectively(what="reduce_scatter_shards_"):
        with pytest.raises((ValueError, TypeError)):
            comm.reduce_scatter_shards_(x, op)
        check_unchanged(x, copies)
    with collectively(what="allreduce after") as blk:
        out = comm.allreduce(x, "sum")
        blk.same(out)
