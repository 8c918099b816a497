"""Gradient-control kernels (docs/GUIDE.md section 2.8): zero_, accumulate_,
accumulate_v2_, all_finite, scale_.

The kernels are local (no communication), but the suite runs under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi`` like every other test
file: every test is rank-independent and deterministic (fixed seeds, not the
rank), each body sits in one ``collectively()`` block so a failure on one rank
fails all ranks together, and the results are also checked to be bitwise
identical across ranks (``blk.same``).

References (kernel_reference.py) are exact: the float32 (float64) sum or
product is computed with NumPy in that dtype (one IEEE operation) and
converted to the destination dtype with a hand-made round-to-nearest-even
(validated against single-rounding casts and rational arithmetic in
kernel_reference.self_check).  Results are compared bitwise; only NaN
payloads are free.

Subprocess tests (rank 0 only, result made collective) run Python without
mpiexec (MPI singleton init): the GRADSYNC_SIMD=none comparison and the
"do_update=False does not read grad" check, which hands the kernel a grad in
memory mapped PROT_NONE (reading it would crash the subprocess, not the job).
"""

import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import warnings

import kernel_reference as kr
import ml_dtypes
import numpy as np
import pytest
from kernel_reference import (
    BF16,
    F16,
    F32,
    F64,
    FLOATS,
    INTS,
    accumulate_ref,
    all_finite_ref,
    all_patterns,
    first_bad,
    near_pairs,
    overwrite_ref,
    random_floats,
    round_f64,
    same_bits,
    scale_ref,
)
from mpi4py import MPI

import gradsync as gs
from gsutil import child_env, collectively, run_child, seed_for

pytestmark = [pytest.mark.mpi,
              # NaN/inf casts in the references and inputs are intended
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

WORLD = MPI.COMM_WORLD
ALL8 = FLOATS + INTS
PAIRS = [(a, g) for a in FLOATS for g in FLOATS]


def pid(dt):
    return np.dtype(dt).name


def pair_id(p):
    return "%s+%s" % (pid(p[0]), pid(p[1]))


def rng_for(*tag):
    """Rank-independent deterministic stream."""
    return np.random.default_rng(seed_for("test_kernels", *tag))


def snapshot(arrays):
    return [np.asarray(a).tobytes() for a in arrays]


def assert_unchanged(arrays, snap, what="tensor"):
    for i, (a, s) in enumerate(zip(arrays, snap)):
        assert np.asarray(a).tobytes() == s, (
            "%s %d (%s %s) was modified" % (what, i, a.dtype, a.shape))


def assert_returns(ret, given, fn):
    """In-place functions return the objects they were given."""
    if isinstance(given, np.ndarray):
        assert ret is given, "%s returned %r, not the array it was given" % (
            fn, type(ret))
        return
    ok = ret is given or (isinstance(ret, (list, tuple))
                          and len(ret) == len(given)
                          and all(r is g for r, g in zip(ret, given)))
    assert ok, "%s did not return the objects it was given: %r" % (fn, ret)


def check_bits(got, ref, what, acc=None, grad=None):
    msg = same_bits(got, ref)
    if msg is None:
        return
    if acc is not None:
        idx = first_bad(got, ref)
        msg += "; inputs: " + kr.describe_pair(acc, grad, idx)
    raise AssertionError("%s: %s" % (what, msg))


def accumulate_checked(acc, grad, what):
    """accumulate_ on a copy of acc (single array); checks return value and
    result against the reference; returns the result."""
    a = acc.copy()
    ret = gs.accumulate_(a, grad)
    assert_returns(ret, a, "accumulate_")
    check_bits(a, accumulate_ref(acc, grad), what, acc, grad)
    return a


def test_reference_self_check():
    """The references' final rounding agrees with single-rounding casts and
    with exact rational arithmetic (kernel_reference.self_check)."""
    with collectively(what="reference self-check"):
        problems = kr.self_check()
        assert not problems, "\n".join(problems[:10])


# ===================================================== ORT's vectors

@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_ort_vectors_accumulate(pair):
    adt, gdt = pair
    with collectively(what="ort accumulate %s" % pair_id(pair)) as blk:
        acc = np.array([1, 2, 3], dtype=adt)
        grad = np.array([4, 5, 6], dtype=gdt)
        ret = gs.accumulate_(acc, grad)
        assert_returns(ret, acc, "accumulate_")
        check_bits(acc, np.array([5, 7, 9], dtype=adt), "[1,2,3]+[4,5,6]")
        # do_update=False: untouched
        acc2 = np.array([1, 2, 3], dtype=adt)
        ret = gs.accumulate_(acc2, grad, do_update=False)
        assert_returns(ret, acc2, "accumulate_(do_update=False)")
        check_bits(acc2, np.array([1, 2, 3], dtype=adt), "do_update=False")
        # v2
        acc3 = np.array([1, 2, 3], dtype=adt)
        ret = gs.accumulate_v2_(acc3, grad, overwrite=True)
        assert isinstance(ret, tuple) and len(ret) == 2, ret
        assert ret[0] is True, "updated flag is %r" % (ret[0],)
        assert ret[1] is acc3, "accumulate_v2_ did not return acc"
        check_bits(acc3, np.array([4, 5, 6], dtype=adt), "v2 overwrite")
        acc4 = np.array([1, 2, 3], dtype=adt)
        ret = gs.accumulate_v2_(acc4, grad)
        assert ret[0] is True and ret[1] is acc4, ret
        check_bits(acc4, np.array([5, 7, 9], dtype=adt), "v2 add")
        blk.same([acc, acc2, acc3, acc4])


def test_ort_vectors_float32_acc_float16_grad_and_zero():
    with collectively(what="ort f32/f16, zero") as blk:
        assert np.dtype(gs.bfloat16) == BF16
        acc = np.array([1, 2, 3], np.float32)
        grad = np.array([4, 5, 6], np.float16)
        gs.accumulate_(acc, grad)
        assert acc.tolist() == [5.0, 7.0, 9.0], acc
        acc = np.array([1, 2, 3], np.float32)
        gs.accumulate_(acc, grad, do_update=False)
        assert acc.tolist() == [1.0, 2.0, 3.0], acc
        acc = np.array([1, 2, 3], np.float32)
        upd, out = gs.accumulate_v2_(acc, grad, overwrite=True)
        assert upd is True and out is acc and acc.tolist() == [4, 5, 6], acc
        outs = []
        for dt in (np.float32, np.float16):
            x = np.array([1, 2, 3], dt)
            ret = gs.zero_(x)
            assert_returns(ret, x, "zero_")
            assert x.tolist() == [0, 0, 0] and not np.any(np.signbit(x)), x
            outs.append(x)
        blk.same(outs)


# ===================================================== single rounding

# (acc dtype, acc value, grad dtype, grad value, expected) -- exact values.
ROUNDING_CASES = [
    # the contract's example: ORT's cast-first would give 1.0
    (F16, 1.0, F32, 2.0 ** -11 + 2.0 ** -22, 1.0009765625),
    # ties to even
    (F16, 2048.0, F16, 1.0, 2048.0),
    (F16, 2048.0, F32, 1.0, 2048.0),
    (F16, 2048.0, F64, 1.0, 2048.0),
    (F16, 2048.0, F16, 3.0, 2052.0),
    (F16, 2050.0, F16, 1.0, 2052.0),
    (F16, -2048.0, F16, -1.0, -2048.0),
    (BF16, 256.0, BF16, 1.0, 256.0),
    (BF16, 256.0, BF16, 3.0, 260.0),
    (BF16, 258.0, BF16, 1.0, 260.0),
    (BF16, 256.0, F32, 1.0, 256.0),
    (BF16, 256.0, F16, 3.0, 260.0),
    (F32, 1.0, F16, 2.0 ** -24, 1.0),          # f32 tie, f16 subnormal grad
    (F32, 1.0 + 2.0 ** -23, F16, 2.0 ** -24, 1.0 + 2.0 ** -22),
    # a float64 side: float64 sum, rounded once (through float32 would tie)
    (F16, 1.0, F64, 2.0 ** -11 + 2.0 ** -40, 1.0009765625),
    (BF16, 1.0, F64, 2.0 ** -8 + 2.0 ** -40, 1.0078125),
    (F32, 1.0, F64, 2.0 ** -24 + 2.0 ** -50, 1.0 + 2.0 ** -23),
    # float32-computed pair: the float32 sum IS a rounding step of the
    # contract (1 + 2^-11 + 2^-34 -> 1 + 2^-11 in float32 -> tie -> 1.0)
    (F16, 1.0, F32, 2.0 ** -11 + 2.0 ** -34, 1.0),
    (BF16, 1.0, F32, 2.0 ** -8 + 2.0 ** -30, 1.0),
    # overflow: 65504 + 16 = 65520 is the tie between max and 2^16 -> inf
    (F16, 65504.0, F16, 16.0, np.inf),
    (F16, 65504.0, F32, 15.99, 65504.0),
    (F16, -65504.0, F16, -16.0, -np.inf),
    (BF16, float(ml_dtypes.finfo(BF16).max), BF16,
     float(ml_dtypes.finfo(BF16).max), np.inf),
    # subnormals: 1.5 * 2^-24 is a tie between 2^-24 (odd) and 2^-23
    (F16, 2.0 ** -24, F32, 2.0 ** -25, 2.0 ** -23),
    (F16, 2.0 ** -24, F32, 2.0 ** -26, 2.0 ** -24),
    (BF16, 2.0 ** -133, F32, 2.0 ** -134, 2.0 ** -132),
    # signed zeros
    (F16, -0.0, F16, -0.0, -0.0),
    (F16, -0.0, F16, 0.0, 0.0),
    (BF16, -0.0, F64, -0.0, -0.0),
    (F32, 1.0, F32, -1.0, 0.0),
]


def test_single_rounding_examples():
    with collectively(what="single rounding") as blk:
        outs = []
        for adt, av, gdt, gv, want in ROUNDING_CASES:
            acc = np.array([av], dtype=adt)
            grad = np.array([gv], dtype=gdt)
            assert grad.astype(F64)[0] == gv or gdt == F32, (
                "test input %r not exact in %s" % (gv, gdt))
            exp = np.array([want], dtype=F64)
            expected = round_f64(exp, adt)
            assert expected.astype(F64)[0] == want or np.isinf(want)
            # the reference agrees with the hand-computed value
            ref = accumulate_ref(acc, grad)
            assert same_bits(ref, expected) is None, (
                "reference disagrees on %r" % ((adt, av, gdt, gv, want),))
            got = acc.copy()
            gs.accumulate_(got, grad)
            check_bits(got, expected, "%s %r + %s %r" % (
                pid(adt), av, pid(gdt), gv))
            got2 = acc.copy()
            gs.accumulate_v2_(got2, grad)
            check_bits(got2, expected, "v2 %s %r + %s %r" % (
                pid(adt), av, pid(gdt), gv))
            outs += [got, got2]
        blk.same(outs)


OVERWRITE_CASES = [
    (F16, F32, 1.0 + 2.0 ** -11 + 2.0 ** -22, 1.0009765625),
    (F16, F64, 1.0 + 2.0 ** -11 + 2.0 ** -40, 1.0009765625),  # not via f32
    (F16, F32, 1.0 + 2.0 ** -11, 1.0),
    (BF16, F64, 1.0 + 2.0 ** -8 + 2.0 ** -40, 1.0078125),     # not via f32
    (BF16, F32, 1.0 + 2.0 ** -8, 1.0),
    (BF16, F16, 1.0 + 2.0 ** -8 + 2.0 ** -10, 1.0078125),
    (F32, F64, 1.0 + 2.0 ** -24, 1.0),
    (F32, F64, 1.0 + 2.0 ** -24 + 2.0 ** -50, 1.0 + 2.0 ** -23),
    (F16, F32, 65520.0, np.inf),
    (F16, F32, 65519.0, 65504.0),
    (F16, F64, 1e300, np.inf),
    (F32, F64, 1e300, np.inf),
    (F16, F64, -0.0, -0.0),
    (F16, F32, 2.0 ** -25, 0.0),           # tie with 0 -> +0
    (F16, F32, 2.0 ** -25 + 2.0 ** -40, 2.0 ** -24),
]


def test_overwrite_rounds_once():
    with collectively(what="overwrite rounding") as blk:
        outs = []
        for adt, gdt, gv, want in OVERWRITE_CASES:
            grad = np.array([gv, -gv], dtype=gdt)
            assert grad.astype(F64)[0] == gv, (gv, gdt)
            expected = round_f64(np.array([want, -want]), adt)
            assert same_bits(overwrite_ref(np.zeros(2, adt), grad),
                             expected) is None, (adt, gdt, gv)
            acc = np.array([7.0, -7.0], dtype=adt)
            upd, out = gs.accumulate_v2_(acc, grad, overwrite=True)
            assert upd is True and out is acc
            check_bits(acc, expected, "overwrite %s <- %s %r" % (
                pid(adt), pid(gdt), gv))
            outs.append(acc)
        blk.same(outs)


def _tie_points(dt):
    """float64 values at, just above and just below the round-to-nearest
    ties of dt in every binade (subnormals and the overflow edge included),
    both signs."""
    p, emin, emax = kr._FORMAT[dt]
    vals = []
    for e in range(emin - p - 1, emax + 1):
        ulp = 2.0 ** (max(e, emin) - p + 1)
        for m in (1.0, 1.25, 1.5, 2.0 - 2.0 ** (1 - p)):
            base = m * 2.0 ** e if e >= emin else ulp * (1 + 2 * int(m * 3))
            t = base + ulp / 2            # a tie
            for d in (0.0, 2.0 ** -30, -2.0 ** -30):
                vals.append(t * (1 + d))
    top = kr._max_finite(dt) + 2.0 ** (emax - p) * np.array(
        [1.0, 1 - 2.0 ** -30, 1 + 2.0 ** -30])   # max + ulp/2 and around
    v = np.concatenate([np.array(vals), top])
    v = v[np.isfinite(v)]
    return np.concatenate([v, -v])


@pytest.mark.parametrize("adt", [F16, BF16, F32], ids=pid)
def test_float64_rounds_once(adt):
    """float64 grads at and around every tie of acc's dtype: overwrite and
    0 + grad round once from float64 (a detour through float32 would turn
    'tie + tiny' into a tie and round it to even)."""
    with collectively(what="float64 -> %s" % pid(adt)) as blk:
        g = _tie_points(adt)
        want = round_f64(g, adt)
        ow = np.zeros(g.size, adt)
        gs.accumulate_v2_(ow, g, overwrite=True)
        check_bits(ow, want, "overwrite from float64", ow, g)
        acc = np.zeros(g.size, adt)
        gs.accumulate_(acc, g)
        check_bits(acc, want, "0 + float64 grad", np.zeros(g.size, adt), g)
        # and float64 acc + 16-bit/float32 grad is exact here: no rounding
        a64 = g.copy()
        gs.accumulate_(a64, np.zeros(g.size, adt))
        check_bits(a64, g, "float64 acc + 0")
        blk.same([ow, acc])


def _acc_samples(adt, rng):
    """16 accumulator values of dtype adt: zeros, ones, ties, extremes,
    specials and random ones."""
    fi = ml_dtypes.finfo(adt)
    vals = [0.0, -0.0, 1.0, -1.0, 2048.0, 256.0, float(fi.max),
            -float(fi.max), float(fi.tiny), float(fi.smallest_subnormal),
            np.inf, -np.inf, np.nan]
    vals = np.array(vals, dtype=F64)
    extra = random_floats(rng, 16 - len(vals), adt, "wide").astype(F64)
    return round_f64(np.concatenate([vals, extra]), adt) \
        if adt != F64 else np.concatenate([vals, extra])


@pytest.mark.parametrize("gdt", [F16, BF16], ids=pid)
@pytest.mark.parametrize("adt", FLOATS, ids=pid)
def test_every_16bit_grad_pattern(adt, gdt):
    """All 65536 bit patterns of a float16/bfloat16 grad against 16
    accumulators, one call (1M elements); and overwrite with every pattern."""
    with collectively(what="all %s grads into %s" % (pid(gdt), pid(adt))) \
            as blk:
        g = all_patterns(gdt)
        grad = np.tile(g, 16).reshape(16, -1)
        a = _acc_samples(adt, rng_for("exh-grad", pid(adt), pid(gdt)))
        acc = np.repeat(a, g.size).reshape(16, -1)
        got = acc.copy()
        gs.accumulate_(got, grad)
        check_bits(got, accumulate_ref(acc, grad), "accumulate", acc, grad)
        ow = np.zeros(g.size, adt)
        gs.accumulate_v2_(ow, g, overwrite=True)
        check_bits(ow, overwrite_ref(ow, g), "overwrite", ow, g)
        blk.same([got, ow])


@pytest.mark.parametrize("gdt", FLOATS, ids=pid)
@pytest.mark.parametrize("adt", [F16, BF16], ids=pid)
def test_every_16bit_acc_pattern(adt, gdt):
    """All 65536 bit patterns of a float16/bfloat16 accumulator against 16
    grads, one call; grads in a flat array, acc 2-D (shapes may differ)."""
    with collectively(what="all %s accs + %s" % (pid(adt), pid(gdt))) as blk:
        a = all_patterns(adt)
        acc = np.tile(a, 16).reshape(16, -1)
        gv = _acc_samples(gdt, rng_for("exh-acc", pid(adt), pid(gdt)))
        grad = np.repeat(gv, a.size)           # 1-D, same element count
        got = acc.copy()
        gs.accumulate_(got, grad)
        check_bits(got, accumulate_ref(acc, grad), "accumulate", acc, grad)
        blk.same(got)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_random_pairs(pair):
    """Random data of several kinds (normal, wide magnitudes, random bits
    with NaN/inf/subnormals, near-cancellation and ties), 50k elements
    each; accumulate_, accumulate_v2_ (add and overwrite)."""
    adt, gdt = pair
    rng = rng_for("random", pair_id(pair))
    with collectively(what="random %s" % pair_id(pair)) as blk:
        outs = []
        n = 50_000
        cases = [(random_floats(rng, n, adt, k), random_floats(rng, n, gdt, k))
                 for k in ("normal", "wide", "bits")]
        cases.append((random_floats(rng, n, adt, "wide"),
                      random_floats(rng, n, gdt, "bits")))
        cases.append(near_pairs(rng, n, adt, gdt))
        for i, (acc, grad) in enumerate(cases):
            outs.append(accumulate_checked(acc, grad, "case %d" % i))
            a2 = acc.copy()
            gs.accumulate_v2_(a2, grad, overwrite=False)
            check_bits(a2, outs[-1], "v2 add case %d" % i, acc, grad)
            a3 = acc.copy()
            gs.accumulate_v2_(a3, grad, overwrite=True)
            check_bits(a3, overwrite_ref(acc, grad), "overwrite case %d" % i,
                       acc, grad)
            outs.append(a3)
        blk.same(outs)


# ===================================================== NaN / inf

@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_nan_inf_propagate(pair):
    adt, gdt = pair
    with collectively(what="nan/inf %s" % pair_id(pair)) as blk:
        big = float(ml_dtypes.finfo(adt).max)
        av = [np.nan, 1.0, np.inf, np.inf, -np.inf, np.inf, -np.inf, np.nan,
              big, -big, 0.0, np.nan, 2.0, -3.0, np.inf, 5.0, 6.0]
        gv = [1.0, np.nan, 1.0, -np.inf, np.inf, np.inf, -1.0, np.nan,
              big, -big, -np.inf, np.inf, 0.0, np.nan, 0.0, 1e-3, -6.0]
        acc = round_f64(np.array(av), adt)
        grad = round_f64(np.array(gv), gdt)
        got = accumulate_checked(acc, grad, "nan/inf")
        isn = np.isnan(got.astype(F64))
        want_nan = [True, True, False, True, True, False, False, True,
                    False, False, False, True, False, True, False, False,
                    False]
        assert isn.tolist() == want_nan, (got, want_nan)
        assert np.isposinf(got.astype(F64)[2]) and \
            np.isneginf(got.astype(F64)[6]), got
        blk.same([np.isnan(got.astype(F64)),
                  np.where(np.isnan(got.astype(F64)), 0, got.astype(F64))])


def test_all_finite_long_list():
    rng = rng_for("all_finite")
    with collectively(what="all_finite") as blk:
        sizes = [int(s) for s in rng.choice([1, 3, 8, 9, 17, 100, 1000, 5000],
                                            size=60)]
        dts = [FLOATS[i] for i in rng.integers(0, 4, size=60)]
        # finite values incl. extremes and subnormals
        ts = []
        for n, dt in zip(sizes, dts):
            fi = ml_dtypes.finfo(dt)
            x = random_floats(rng, n, dt, "wide")
            x[0] = fi.max
            x[-1] = -fi.max if n > 1 else x[-1]
            x[n // 2] = fi.smallest_subnormal
            ts.append(x)
        snap = snapshot(ts)
        r = gs.all_finite(ts)
        assert type(r) is bool, "all_finite returned %r, not bool" % type(r)
        assert r is True, "all_finite of finite tensors is %r" % r
        assert gs.all_finite(tuple(ts)) is True
        results = [r]
        for dt in FLOATS:
            for bad in (np.nan, np.inf, -np.inf):
                for where in ("last", "middle", "first"):
                    ts2 = [t.copy() for t in ts]
                    if where == "last":
                        k, pos = len(ts2) - 1, ts2[-1].size - 1
                    elif where == "middle":
                        k = len(ts2) // 2
                        pos = ts2[k].size // 2
                    else:
                        k, pos = 0, 0
                    with np.errstate(over="ignore"):  # max -> inf is fine
                        ts2[k] = np.clip(ts2[k].astype(F64), -1e4,
                                         1e4).astype(dt)  # the bad one in dt
                    ts2[k].reshape(-1)[pos] = bad
                    r = gs.all_finite(ts2)
                    assert r is False, (
                        "all_finite missed %r in %s tensor %d at %d (%s)"
                        % (bad, pid(dt), k, pos, where))
                    results.append(r)
        assert_unchanged(ts, snap)
        blk.same(np.array(results))


def test_all_finite_positions_and_edges():
    with collectively(what="all_finite positions") as blk:
        # empties
        assert gs.all_finite([]) is True
        assert gs.all_finite([np.zeros(0, dt) for dt in FLOATS]) is True
        assert gs.all_finite(np.zeros(0, F16)) is True
        assert gs.all_finite(np.zeros((0, 3), BF16)) is True
        res = []
        for dt in FLOATS:
            for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65):
                base = np.ones(n + 2, dt)
                x = base[1:-1]                      # unaligned start
                base[0] = np.nan
                base[-1] = np.inf
                r = gs.all_finite(x)
                assert r is True, (
                    "all_finite read outside the array (%s n=%d)" % (dt, n))
                for pos in range(n):
                    for bad in (np.nan, -np.inf):
                        x[pos] = bad
                        r = gs.all_finite(x)
                        assert r is False, "%s n=%d %r at %d" % (
                            pid(dt), n, bad, pos)
                        x[pos] = 1
                        res.append(r)
                # NaN with payloads, +inf bit pattern, signalling NaN
                u = kr.uint_view(x)
                exp_mask = {2: (0x7c00 if dt == F16 else 0x7f80),
                            4: 0x7f800000, 8: 0x7ff0000000000000}[dt.itemsize]
                for pattern in (exp_mask, exp_mask | 1,
                                exp_mask | (exp_mask >> 3)):
                    u[n - 1] = pattern
                    assert gs.all_finite(x) is False, (pid(dt), hex(pattern))
                    x[n - 1] = 1
        # read-only input is fine
        y = np.ones(10, F32)
        y.setflags(write=False)
        assert gs.all_finite(y) is True
        blk.same(np.array(res))


def test_zero_clears_everything():
    rng = rng_for("zero")
    with collectively(what="zero_") as blk:
        outs = []
        for dt in ALL8:
            for n in (0, 1, 7, 8, 9, 33, 1023, 4097):
                x = kr.random_floats(rng, n, dt, "bits") if dt in FLOATS \
                    else rng.integers(0, 256, n * dt.itemsize,
                                      dtype=np.uint8).view(dt).copy()
                if dt in FLOATS and n:
                    x[0] = np.nan
                    x[-1] = -np.inf
                    x[n // 2] = -0.0
                ret = gs.zero_(x)
                assert_returns(ret, x, "zero_")
                assert not np.any(x.view(np.uint8)), (
                    "zero_ %s n=%d left nonzero bits" % (pid(dt), n))
                outs.append(x)
        # lists of mixed dtypes and shapes, tuple too
        ts = [rng.integers(0, 256, int(k) * ALL8[i % 8].itemsize,
                           dtype=np.uint8).view(ALL8[i % 8]).reshape(-1, 1)
              for i, k in enumerate(rng.integers(0, 300, size=40))]
        ret = gs.zero_(ts)
        assert_returns(ret, ts, "zero_(list)")
        for i, t in enumerate(ts):
            assert not np.any(t.view(np.uint8)), "list element %d" % i
        tup = tuple(np.full(5, -0.0, dt) for dt in FLOATS)
        ret = gs.zero_(tup)
        assert_returns(ret, tup, "zero_(tuple)")
        assert all(not np.any(t.view(np.uint8)) for t in tup)
        # guards around an unaligned view stay as they are
        for dt in ALL8:
            base = np.full(40, 3, dt)
            gs.zero_(base[1:-1])
            assert base[0] == 3 and base[-1] == 3 and not np.any(
                base[1:-1].view(np.uint8)), pid(dt)
        empty = []
        assert_returns(gs.zero_(empty), empty, "zero_([])")
        blk.same(outs + ts)


# ===================================================== sizes

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1023, 1024,
         1025]


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_sizes_and_alignment(pair):
    """Every SIMD tail length, at aligned and unaligned addresses, with
    guard elements on both sides that must stay untouched."""
    adt, gdt = pair
    rng = rng_for("sizes", pair_id(pair))
    with collectively(what="sizes %s" % pair_id(pair)) as blk:
        outs = []
        for n in SIZES:
            for off in (0, 1, 3):
                kind = {0: "wide", 1: "bits", 3: "normal"}[off]
                acc0 = random_floats(rng, n, adt, kind)
                grad0 = random_floats(rng, n, gdt, kind)
                abuf = np.full(n + off + 5, 77, adt)
                gbuf = np.full(n + off + 5, 99, gdt)
                acc = abuf[off:off + n]
                grad = gbuf[off:off + n]
                acc[...] = acc0
                grad[...] = grad0
                what = "n=%d off=%d" % (n, off)
                ret = gs.accumulate_(acc, grad)
                assert_returns(ret, acc, "accumulate_")
                check_bits(acc, accumulate_ref(acc0, grad0), what, acc0,
                           grad0)
                assert np.all(abuf[:off] == 77) and np.all(
                    abuf[off + n:] == 77), "guard overwritten " + what
                assert np.all(gbuf[:off] == 99) and np.all(
                    gbuf[off + n:] == 99), "grad guard overwritten " + what
                outs.append(acc.copy())
                acc[...] = acc0
                gs.accumulate_v2_(acc, grad, overwrite=True)
                check_bits(acc, overwrite_ref(acc0, grad0), "ovw " + what)
                assert np.all(abuf[off + n:] == 77), "guard (ovw) " + what
                if gdt == adt:
                    acc[...] = acc0
                    gs.scale_(acc, 0.1)
                    check_bits(acc, scale_ref(acc0, 0.1), "scale " + what)
                    assert np.all(abuf[off + n:] == 77), "guard scale " + what
                    gs.zero_(acc)
                    assert not np.any(acc.view(np.uint8)), what
                    assert np.all(abuf[off + n:] == 77) and np.all(
                        abuf[:off] == 77), "guard zero " + what
        blk.same(outs)


LARGE = 3_000_003   # odd, so no thread split is a multiple of 8


@pytest.mark.parametrize("pair", [(F32, F16), (F16, F32), (BF16, BF16),
                                  (F64, F32), (F32, F32), (BF16, F64)],
                         ids=pair_id)
def test_large(pair):
    """3M elements (the implementation may split the pass across threads):
    equal bitwise to the reference and to the same data run in 4096-element
    calls."""
    adt, gdt = pair
    rng = rng_for("large", pair_id(pair))
    with collectively(what="large %s" % pair_id(pair)) as blk:
        acc0 = random_floats(rng, LARGE, adt, "wide")
        grad = random_floats(rng, LARGE, gdt, "wide")
        grad[::99991] = random_floats(rng, grad[::99991].size, gdt, "bits")
        acc = acc0.copy()
        gs.accumulate_(acc, grad)
        check_bits(acc, accumulate_ref(acc0, grad), "accumulate", acc0, grad)
        chunked = acc0.copy()
        for i in range(0, LARGE, 4096):
            gs.accumulate_(chunked[i:i + 4096], grad[i:i + 4096])
        assert acc.tobytes() == chunked.tobytes(), (
            "3M-element call differs from 4096-element calls at %s"
            % first_bad(acc, chunked)[:5])
        ow = acc0.copy()
        gs.accumulate_v2_(ow, grad, overwrite=True)
        check_bits(ow, overwrite_ref(acc0, grad), "overwrite", acc0, grad)
        if adt == gdt:
            sc = acc0.copy()
            gs.scale_(sc, -0.3)
            check_bits(sc, scale_ref(acc0, -0.3), "scale")
        # all_finite: finite, then one NaN/inf in the last element, in a
        # middle thread's share, at the start of the last quarter
        fin = acc0.copy()
        fin[~np.isfinite(fin.astype(F64))] = 0
        assert gs.all_finite(fin) is True
        for pos in (LARGE - 1, LARGE // 2 + 1, 3 * LARGE // 4, 1):
            fin[pos] = np.inf if pos % 2 else np.nan
            assert gs.all_finite(fin) is False, "missed at %d" % pos
            fin[pos] = 0
        gs.zero_(acc)
        assert not np.any(acc.view(np.uint8)), "zero_ 3M"
        blk.same([chunked, ow])


# ===================================================== fused lists

def _mixed_pairs(rng, npairs=50):
    accs, grads = [], []
    for i in range(npairs):
        n = int(rng.choice([0, 1, 2, 7, 8, 9, 16, 17, 100, 1023, 4096, 9999,
                            70000]))
        adt = FLOATS[rng.integers(4)]
        gdt = FLOATS[rng.integers(4)]
        kind = ("normal", "wide", "bits")[i % 3]
        a = random_floats(rng, n, adt, kind)
        g = random_floats(rng, n, gdt, kind)
        if n and n % 2 == 0:           # shapes may differ, counts equal
            a = a.reshape(2, -1)
        if n == 9:
            g = g.reshape(3, 3)
        accs.append(a)
        grads.append(g)
    return accs, grads


def test_fused_list_equals_per_pair():
    rng = rng_for("fused")
    with collectively(what="fused 50 pairs") as blk:
        accs0, grads = _mixed_pairs(rng)
        gsnap = snapshot(grads)
        accs = [a.copy() for a in accs0]
        ret = gs.accumulate_(accs, grads)
        assert_returns(ret, accs, "accumulate_(list)")
        for i, (a0, a, g) in enumerate(zip(accs0, accs, grads)):
            single = a0.copy()
            gs.accumulate_(single, g)
            assert a.tobytes() == single.tobytes(), (
                "pair %d (%s+%s, n=%d): fused differs from a single call"
                % (i, a.dtype, g.dtype, a.size))
            check_bits(a, accumulate_ref(a0, g), "pair %d" % i, a0, g)
        assert_unchanged(grads, gsnap, "grad")
        # tuples
        tacc = tuple(a.copy() for a in accs0)
        ret = gs.accumulate_(tacc, tuple(grads))
        assert_returns(ret, tacc, "accumulate_(tuple)")
        assert all(x.tobytes() == y.tobytes() for x, y in zip(tacc, accs))
        # v2, add and overwrite
        v2 = [a.copy() for a in accs0]
        upd, ret = gs.accumulate_v2_(v2, grads)
        assert upd is True
        assert_returns(ret, v2, "accumulate_v2_(list)")
        assert all(x.tobytes() == y.tobytes() for x, y in zip(v2, accs))
        ow = [a.copy() for a in accs0]
        upd, ret = gs.accumulate_v2_(ow, grads, overwrite=True)
        assert upd is True
        for i, (a0, a, g) in enumerate(zip(accs0, ow, grads)):
            check_bits(a, overwrite_ref(a0, g), "overwrite pair %d" % i)
        # do_update=False on the list
        nd = [a.copy() for a in accs0]
        ret = gs.accumulate_(nd, grads, do_update=False)
        assert_returns(ret, nd, "accumulate_(list, do_update=False)")
        assert_unchanged(nd, snapshot(accs0), "acc")
        # scale_ / zero_ / all_finite on the mixed list
        sc = [a.copy() for a in accs0]
        ret = gs.scale_(sc, 1.7)
        assert_returns(ret, sc, "scale_(list)")
        for i, (a0, a) in enumerate(zip(accs0, sc)):
            check_bits(a, scale_ref(a0, 1.7), "scale pair %d" % i)
        assert gs.all_finite(accs0) is all_finite_ref(accs0)
        assert gs.all_finite([a for a in accs0 if a.size and np.all(
            np.isfinite(a.astype(F64)))]) is True
        gs.zero_(sc)
        assert all(not np.any(a.view(np.uint8)) for a in sc)
        blk.same(accs + ow)


def test_fused_many_small_pairs():
    """500 tiny pairs in one call (per-pair overhead / bookkeeping)."""
    rng = rng_for("many")
    with collectively(what="500 pairs") as blk:
        accs0 = [random_floats(rng, int(rng.integers(0, 20)), FLOATS[i % 4],
                               "wide") for i in range(500)]
        grads = [random_floats(rng, a.size, FLOATS[(i // 4) % 4], "wide")
                 for i, a in enumerate(accs0)]
        accs = [a.copy() for a in accs0]
        gs.accumulate_(accs, grads)
        for i, (a0, a, g) in enumerate(zip(accs0, accs, grads)):
            check_bits(a, accumulate_ref(a0, g), "pair %d" % i, a0, g)
        blk.same(accs)


def test_fused_threaded_many_pairs():
    """A fused list whose total (1.6M elements) crosses the size at which
    the pass may be split across threads, made of pairs that are each
    small: every pair equals its own single call and the reference."""
    rng = rng_for("threaded")
    with collectively(what="fused threaded") as blk:
        sizes = rng.integers(1, 11000, size=300)
        accs0 = [random_floats(rng, int(n), FLOATS[i % 4], "wide")
                 for i, n in enumerate(sizes)]
        grads = [random_floats(rng, a.size, FLOATS[(i // 4) % 4], "wide")
                 for i, a in enumerate(accs0)]
        assert sum(a.size for a in accs0) > (1 << 20) * 1.5
        accs = [a.copy() for a in accs0]
        gs.accumulate_(accs, grads)
        for i, (a0, a, g) in enumerate(zip(accs0, accs, grads)):
            check_bits(a, accumulate_ref(a0, g), "pair %d" % i, a0, g)
            if i % 25 == 0:
                single = a0.copy()
                gs.accumulate_(single, g)
                assert single.tobytes() == a.tobytes(), "pair %d" % i
        sc = [a.copy() for a in accs0]
        gs.scale_(sc, -2.5)
        for i, (a0, a) in enumerate(zip(accs0, sc)):
            check_bits(a, scale_ref(a0, -2.5), "scale pair %d" % i)
        assert gs.all_finite(accs0) is True
        last = [a.copy() for a in accs0]
        last[-1][-1] = np.nan
        assert gs.all_finite(last) is False
        mid = [a.copy() for a in accs0]
        mid[150][mid[150].size // 2] = -np.inf
        assert gs.all_finite(mid) is False
        blk.same(accs + sc)


def test_empty_lists():
    with collectively(what="empty lists"):
        a, g = [], []
        assert_returns(gs.accumulate_(a, g), a, "accumulate_([], [])")
        upd, ret = gs.accumulate_v2_(a, g, overwrite=True)
        assert upd is True
        assert_returns(ret, a, "accumulate_v2_([], [])")
        x = []
        assert_returns(gs.scale_(x, 2.0), x, "scale_([])")
        z = [np.zeros(0, d) for d in FLOATS]
        assert_returns(gs.accumulate_(z, list(reversed(z))), z,
                       "accumulate_ of empty arrays")
        assert_returns(gs.scale_(z, 3.0), z, "scale_ of empty arrays")


# ===================================================== scale_

FACTORS = [0.5, 3.0, 0.1, -1.7, 1e-3, 0.0, -0.0, 2.0 ** -30, 1e30, 7,
           1.0, -1.0, 65504.0 * 2]


@pytest.mark.parametrize("dt", FLOATS, ids=pid)
def test_scale(dt):
    rng = rng_for("scale", pid(dt))
    with collectively(what="scale_ %s" % pid(dt)) as blk:
        outs = []
        for kind in ("normal", "wide", "bits"):
            x0 = random_floats(rng, 4099, dt, kind)
            for f in FACTORS:
                x = x0.copy()
                ret = gs.scale_(x, f)
                assert_returns(ret, x, "scale_")
                check_bits(x, scale_ref(x0, f), "%s x %r" % (kind, f))
                outs.append(x)
        # exact hand-checked values
        if dt == F16:
            x = np.array([1.5, 1.0, 65504.0, -2.0 ** -24], F16)
            gs.scale_(x, 2.0)
            assert x.astype(F64).tolist() == [3.0, 2.0, np.inf,
                                              -2.0 ** -23], x
            # 3 * (1 + 2^-10) = 3 + 3*2^-10 -> f16 ulp at 2 is 2^-9: tie
            # (3 + 1.5 ulp) -> 3 + 2*2^-9
            x = np.array([1 + 2.0 ** -10], F16)
            gs.scale_(x, 3.0)
            assert x[0] == np.float16(3 + 2.0 ** -8), x
        if dt == BF16:
            x = np.array([1 + 2.0 ** -7], BF16)
            gs.scale_(x, 3.0)   # 3 + 3*2^-7: ulp 2^-6 -> 3 + 1.5 ulp -> +2
            assert float(x[0]) == 3 + 2.0 ** -5, x
        blk.same(outs)


@pytest.mark.parametrize("dt", INTS + [np.dtype(np.complex64),
                                       np.dtype(np.bool_),
                                       np.dtype(np.uint16)], ids=pid)
def test_scale_rejects_non_floats(dt):
    with collectively(what="scale_ %s" % pid(dt)):
        x = np.arange(10).astype(dt)
        snap = x.tobytes()
        with pytest.raises(TypeError) as ei:
            gs.scale_(x, 2.0)
        assert pid(dt) in str(ei.value), (
            "TypeError does not name %s: %r" % (pid(dt), str(ei.value)))
        assert x.tobytes() == snap
        # as the last element of a list: nothing written into the floats
        fl = [np.ones(17, d) for d in FLOATS]
        fsnap = snapshot(fl)
        with pytest.raises(TypeError):
            gs.scale_(fl + [x], 2.0)
        assert_unchanged(fl, fsnap)
        assert x.tobytes() == snap


# ===================================================== errors

BAD_DTYPES = INTS + [np.dtype(np.complex64), np.dtype(np.bool_),
                     np.dtype(np.uint16)]


def _expect(exc, fn, tensors, words=(), what=""):
    snap = snapshot(tensors)
    with pytest.raises(exc) as ei:
        fn()
    msg = str(ei.value)
    for w in words:
        assert w in msg, "%s: %s message %r does not name %r" % (
            what, exc.__name__, msg, w)
    assert_unchanged(tensors, snap, what + ": tensor")


@pytest.mark.parametrize("bad", BAD_DTYPES, ids=pid)
def test_accumulate_bad_dtypes(bad):
    with collectively(what="bad dtype %s" % pid(bad)):
        x = np.arange(6).astype(bad)
        for good in FLOATS:
            acc = np.ones(6, good)
            grad = np.ones(6, good)
            _expect(TypeError, lambda: gs.accumulate_(x, grad), [x, grad],
                    [pid(bad)], "acc %s" % pid(bad))
            _expect(TypeError, lambda: gs.accumulate_(acc, x), [acc, x],
                    [pid(bad)], "grad %s" % pid(bad))
            _expect(TypeError, lambda: gs.accumulate_v2_(acc, x,
                                                         overwrite=True),
                    [acc, x], [pid(bad)], "v2 grad %s" % pid(bad))
            _expect(TypeError, lambda: gs.accumulate_v2_(x, grad),
                    [x, grad], [pid(bad)], "v2 acc %s" % pid(bad))
        # the bad pair last in a list: the good pairs are not written
        accs = [np.ones(5, d) for d in FLOATS]
        grads = [np.ones(5, d) for d in FLOATS]
        _expect(TypeError, lambda: gs.accumulate_(accs + [np.ones(6, F32)],
                                                  grads + [x]),
                accs + grads, [pid(bad)], "list with bad grad last")
        _expect(TypeError, lambda: gs.accumulate_(accs + [x],
                                                  grads + [np.ones(6, F32)]),
                accs + grads, [pid(bad)], "list with bad acc last")
        _expect(TypeError, lambda: gs.accumulate_v2_(
            accs + [x], grads + [np.ones(6, F32)], overwrite=True),
            accs + grads, [pid(bad)], "v2 list with bad acc last")
        if bad not in INTS:
            _expect(TypeError, lambda: gs.zero_([np.ones(5, F32), x]),
                    [x], [pid(bad)], "zero_")
            z = [np.ones(5, F32), np.ones(3, F16)]
            _expect(TypeError, lambda: gs.zero_(z + [x]), z, [pid(bad)],
                    "zero_ list with bad last")
            _expect(TypeError, lambda: gs.all_finite([np.ones(5, F32), x]),
                    [x], [pid(bad)], "all_finite")


def test_accumulate_count_mismatch_and_shapes():
    with collectively(what="counts"):
        acc = np.ones((2, 3), F32)
        grad = np.ones(7, F16)
        _expect(ValueError, lambda: gs.accumulate_(acc, grad), [acc, grad],
                what="6 vs 7")
        _expect(ValueError, lambda: gs.accumulate_v2_(acc, grad,
                                                      overwrite=True),
                [acc, grad], what="v2 6 vs 7")
        _expect(ValueError, lambda: gs.accumulate_(acc, np.ones(0, F32)),
                [acc], what="6 vs 0")
        # equal counts, different shapes: fine
        g = np.arange(6, dtype=F16).reshape(3, 2)
        gs.accumulate_(acc, g)
        assert acc.tolist() == [[1, 2, 3], [4, 5, 6]], acc
        # later pair mismatching: earlier pairs untouched
        accs = [np.ones(4, d) for d in FLOATS] + [np.ones(10, F32)]
        grads = [np.ones(4, d) for d in reversed(FLOATS)] + [np.ones(11, F32)]
        _expect(ValueError, lambda: gs.accumulate_(accs, grads),
                accs + grads, what="last pair 10 vs 11")
        _expect(ValueError, lambda: gs.accumulate_v2_(accs, grads),
                accs + grads, what="v2 last pair 10 vs 11")
        # list lengths differ
        _expect(ValueError, lambda: gs.accumulate_(accs, grads[:-1]),
                accs + grads, what="5 accs, 4 grads")
        _expect(ValueError, lambda: gs.accumulate_(accs[:-1], grads),
                accs + grads, what="4 accs, 5 grads")


def test_accumulate_readonly_and_noncontiguous():
    with collectively(what="read-only / non-contiguous"):
        ro = np.ones(8, F32)
        ro.setflags(write=False)
        g = np.ones(8, F16)
        _expect(ValueError, lambda: gs.accumulate_(ro, g), [ro], what="ro")
        _expect(ValueError, lambda: gs.accumulate_v2_(ro, g, overwrite=True),
                [ro], what="v2 ro")
        strided_buf = np.ones(16, F32)
        strided = strided_buf[::2]
        _expect(ValueError, lambda: gs.accumulate_(strided, g),
                [strided_buf], what="strided acc")
        fort = np.ones((4, 2), F32, order="F")
        _expect(ValueError, lambda: gs.accumulate_(fort, g), [fort],
                what="Fortran-order acc")
        acc = np.ones(8, F32)
        gbuf = np.ones(16, F16)
        _expect(ValueError, lambda: gs.accumulate_(acc, gbuf[::2]), [acc],
                what="strided grad")
        # a bad acc last in a list: earlier accs untouched
        for bad, what in ((ro, "read-only"), (strided, "strided")):
            accs = [np.ones(8, d) for d in FLOATS] + [bad]
            grads = [np.ones(8, d) for d in FLOATS] + [g]
            _expect(ValueError, lambda: gs.accumulate_(accs, grads),
                    accs + [strided_buf], what="list, %s last" % what)
            _expect(ValueError, lambda: gs.accumulate_v2_(accs, grads,
                                                          overwrite=True),
                    accs + [strided_buf], what="v2 list, %s last" % what)
        # zero_ and scale_ write too
        fl = [np.ones(5, d) for d in FLOATS]
        _expect(ValueError, lambda: gs.zero_(fl + [ro]), fl + [ro],
                what="zero_ read-only last")
        _expect(ValueError, lambda: gs.scale_(fl + [ro], 3.0), fl + [ro],
                what="scale_ read-only last")
        _expect(ValueError, lambda: gs.zero_(fl + [strided]),
                fl + [strided_buf], what="zero_ strided last")
        _expect(ValueError, lambda: gs.scale_(fl + [strided], 3.0),
                fl + [strided_buf], what="scale_ strided last")
        # a read-only grad is fine (only read)
        acc = np.ones(8, BF16)
        gro = np.full(8, 2, F32)
        gro.setflags(write=False)
        gs.accumulate_(acc, gro)
        assert acc.astype(F64).tolist() == [3.0] * 8, acc
        upd, _ = gs.accumulate_v2_(acc, gro, overwrite=True)
        assert upd is True and acc.astype(F64).tolist() == [2.0] * 8


def test_do_update_false_leaves_acc():
    rng = rng_for("noupdate")
    with collectively(what="do_update=False") as blk:
        outs = []
        for adt, gdt in PAIRS:
            acc = random_floats(rng, 100, adt, "bits")
            grad = random_floats(rng, 100, gdt, "bits")
            snap = snapshot([acc, grad])
            ret = gs.accumulate_(acc, grad, do_update=False)
            assert_returns(ret, acc, "accumulate_(do_update=False)")
            assert_unchanged([acc, grad], snap)
            outs.append(acc)
        blk.same(outs)


# ===================================================== subprocess checks

_NOREAD_SCRIPT = textwrap.dedent("""
    import ctypes, mmap, sys
    import numpy as np
    import gradsync as gs
    from kernel_reference import FLOATS
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 100000
    maps = []
    def noaccess(dt):
        m = mmap.mmap(-1, n * 8 + 8192)
        maps.append(m)
        buf = np.frombuffer(m, dtype=np.uint8)
        addr = buf.__array_interface__["data"][0]
        assert libc.mprotect(addr, len(buf), 0) == 0
        return buf[:n * dt.itemsize].view(dt)
    for adt in FLOATS:
        for gdt in FLOATS:
            acc = np.arange(n, dtype=np.float64).astype(adt)
            before = acc.tobytes()
            g = noaccess(gdt)
            r = gs.accumulate_(acc, g, do_update=False)
            assert r is acc
            r = gs.accumulate_([acc, acc[:10].copy()], [g, g[:10]],
                               do_update=False)
            assert acc.tobytes() == before, (adt, gdt)
    print("NOREAD-OK")
""")


def test_do_update_false_does_not_read_grad():
    """grad lives in PROT_NONE memory: any read of it kills the child."""
    with collectively(what="do_update=False reads grad"):
        if WORLD.rank == 0:
            p = run_child(_NOREAD_SCRIPT)
            assert p.returncode == 0 and "NOREAD-OK" in p.stdout, (
                "child exited %d (%s)\nstdout: %s\nstderr: %s" % (
                    p.returncode,
                    "SIGSEGV: grad was read" if p.returncode == -11 else "",
                    p.stdout[-2000:], p.stderr[-3000:]))


_SIMD_SCRIPT = textwrap.dedent("""
    import pickle, sys
    import numpy as np
    import gradsync as gs
    from kernel_reference import simd_workload, run_workload
    res = run_workload(gs, simd_workload())
    out = {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in res.items()}
    with open(sys.argv[1], "wb") as f:
        pickle.dump({"simd": gs.build_info()["simd"], "res": out}, f)
    print("SIMD-OK")
""")


def _workload_reference_check(work, res):
    """The in-process results of simd_workload against the reference."""
    for item in work:
        name, kind = item[0], item[1]
        if kind == "accumulate":
            check_bits(res[name], accumulate_ref(item[2], item[3]), name,
                       item[2], item[3])
        elif kind == "overwrite":
            check_bits(res[name], overwrite_ref(item[2], item[3]), name)
        elif kind == "scale":
            check_bits(res[name], scale_ref(item[2], float(item[3])), name)
        elif kind == "all_finite":
            assert bool(res[name]) == all_finite_ref([item[2]]), name
        elif kind == "fused":
            for i, (a, g) in enumerate(zip(item[2], item[3])):
                check_bits(res["%s/%d" % (name, i)], accumulate_ref(a, g),
                           "%s/%d" % (name, i), a, g)


_SIMD_CACHE = {}


def _simd_comparison():
    """Rank 0 only; run once per session: the workload in this process and
    in a GRADSYNC_SIMD=none child.  Returns a dict with "skip" (a reason the
    child could not run: compared to the reference only) or "here", "there"
    (simd levels), "mine", "theirs" ({name: (dtype, shape, bytes)})."""
    if _SIMD_CACHE:
        return _SIMD_CACHE
    work = kr.simd_workload()
    mine = kr.run_workload(gs, work)
    _SIMD_CACHE["work"] = work
    _SIMD_CACHE["mine"] = mine
    _SIMD_CACHE["here"] = gs.build_info().get("simd")
    probe = run_child("import gradsync; print('PROBE-OK')", timeout=120)
    if probe.returncode != 0 or "PROBE-OK" not in probe.stdout:
        _SIMD_CACHE["skip"] = (
            "gradsync cannot start without mpiexec here (singleton MPI init "
            "failed): SIMD-vs-portable compared to the reference only.\n%s"
            % probe.stderr[-2000:])
        return _SIMD_CACHE
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "portable.pkl")
        p = subprocess.run([sys.executable, "-c", _SIMD_SCRIPT, out],
                           env={**child_env(), "GRADSYNC_SIMD": "none"},
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0 or "SIMD-OK" not in p.stdout:
            _SIMD_CACHE["error"] = "portable child failed (%d)\n%s\n%s" % (
                p.returncode, p.stdout[-2000:], p.stderr[-4000:])
            return _SIMD_CACHE
        with open(out, "rb") as f:
            theirs = pickle.load(f)
    _SIMD_CACHE["there"] = theirs["simd"]
    _SIMD_CACHE["theirs"] = theirs["res"]
    return _SIMD_CACHE


def _simd_diffs(c, nan_payloads):
    """Differences between the SIMD and portable results; nan_payloads=False
    lets any NaN match any NaN."""
    mine, theirs = c["mine"], c["theirs"]
    assert set(theirs) == set(mine), "different result sets"
    diffs = []
    for name in sorted(mine):
        v = mine[name]
        dt, shape, raw = theirs[name]
        if (dt, tuple(shape)) != (str(v.dtype), v.shape):
            diffs.append("%s: %s%s vs %s%s" % (name, v.dtype, v.shape, dt,
                                               shape))
            continue
        if raw == v.tobytes():
            continue
        other = np.frombuffer(raw, dtype=v.dtype).reshape(v.shape)
        mu = kr.uint_view(v).reshape(-1)
        ou = kr.uint_view(other).reshape(-1)
        idx = np.flatnonzero(mu != ou)
        with np.errstate(all="ignore"):
            both_nan = (np.isnan(v.reshape(-1)[idx].astype(F64))
                        & np.isnan(other.reshape(-1)[idx].astype(F64)))
        if not nan_payloads:
            idx = idx[~both_nan]
            if not idx.size:
                continue
        w = v.dtype.itemsize * 2
        diffs.append("%s: %d elements differ%s, e.g. [%d]: simd 0x%0*x "
                     "portable 0x%0*x" % (
                         name, idx.size,
                         " (NaN payloads only)" if both_nan.all() else "",
                         idx[0], w, int(mu[idx[0]]), w, int(ou[idx[0]])))
    return diffs


def _simd_check(nan_payloads):
    c = _simd_comparison()
    _workload_reference_check(c["work"], c["mine"])
    if "skip" in c:
        warnings.warn(c["skip"], stacklevel=1)
        return
    assert "error" not in c, c.get("error")
    assert c["there"] == "portable", (
        "GRADSYNC_SIMD=none child reports simd=%r" % (c["there"],))
    if c["here"] == "portable":
        warnings.warn("this CPU runs the portable kernels in-process too: "
                      "the SIMD comparison is vacuous", stacklevel=1)
    diffs = _simd_diffs(c, nan_payloads)
    assert not diffs, ("SIMD (%s) and portable kernels differ in %d results"
                       "%s:\n%s" % (c["here"], len(diffs),
                                    " (bitwise, NaN payloads included)"
                                    if nan_payloads else "",
                                    "\n".join(diffs[:20])))


def test_simd_matches_portable():
    """GRADSYNC_SIMD=none (portable kernels, chosen at library load) in a
    singleton-MPI child gives the same results as this process's kernels
    (AVX2/F16C where the CPU has them) on a fixed workload: every pair and
    tail length, random bits, exhaustive 16-bit grads, near-cancellation,
    overwrite, scale_, all_finite, one fused list.  Bitwise, except that
    any NaN matches any NaN (see the next test for payloads); the
    in-process results are also checked against the reference."""
    with collectively(what="SIMD vs portable"):
        if WORLD.rank == 0:
            _simd_check(nan_payloads=False)


def test_simd_matches_portable_nan_payloads():
    """The same comparison, fully bitwise: docs/GUIDE.md section 2.8
    promises a portable fallback with identical results, NaN bit patterns included."""
    with collectively(what="SIMD vs portable (NaN payloads)"):
        if WORLD.rank == 0:
            _simd_check(nan_payloads=True)
