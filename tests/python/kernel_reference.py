"""Exact NumPy references for the gradient-control kernels (docs/GUIDE.md section 2.8).

The contract:

* ``accumulate_(acc, grad)``: both sides are widened to float32 (float64 when
  either side is float64), added there (one IEEE addition: itself correctly
  rounded to float32 / float64), and that sum is converted to acc's dtype with
  round to nearest even -- no other rounding step.
* ``accumulate_v2_(acc, grad, overwrite=True)``: acc takes grad's values,
  converted to acc's dtype with ONE rounding (a float64 grad into a float16
  accumulator is rounded once from float64, not through float32).
* ``scale_(x, factor)``: x widened to float32 (float64 for float64) times
  float32(factor) (float64 factor for float64), the product converted to x's
  dtype with round to nearest even.

The final conversion is done here without NumPy's or ml_dtypes' casts
(``round_f64``): the value (held exactly in float64) is divided by the
target's ulp at its binade (a power of two, so exact), rounded to an integer
with ``np.rint`` (round half to even) and multiplied back.  Overflow goes to
inf exactly where IEEE RNE sends it (at or past max + ulp/2).  The casts
(numpy float32/float64 -> float16, ml_dtypes float32 -> bfloat16) are checked
against it in ``self_check()``; ml_dtypes' float64 -> bfloat16 is not used
(older versions round through float32, i.e. twice).

``same_bits`` compares results bitwise, except that any NaN matches any NaN
(the contract fixes neither payload nor quiet bit).

This module is also imported by the GRADSYNC_SIMD=none subprocess of
test_kernels.py (``simd_workload`` / ``run_workload``), so it imports gradsync
lazily.
"""

import functools

import ml_dtypes
import numpy as np

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
FLOATS = [F16, BF16, F32, F64]
INTS = [np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32),
        np.dtype(np.int64)]

# precision p (bits, hidden bit included), emin, emax
_FORMAT = {F16: (11, -14, 15), BF16: (8, -126, 127), F32: (24, -126, 127)}

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _quiet(fn):
    """NaN/inf casts are intended here: no RuntimeWarnings."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


def uint_view(a):
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def compute_dtype(acc_dt, grad_dt=None):
    """float64 when either side is float64, else float32."""
    dts = [np.dtype(acc_dt)] + ([] if grad_dt is None else [np.dtype(grad_dt)])
    return F64 if F64 in dts else F32


def _max_finite(dt):
    p, _, emax = _FORMAT[dt]
    return (2.0 - 2.0 ** (1 - p)) * 2.0 ** emax


@_quiet
def round_f64(x, dt):
    """float64 array -> dtype ``dt`` with one round-to-nearest-even step.

    float32 and float16 use NumPy's casts (correctly rounded from float64;
    checked against round_f64_exact in self_check), bfloat16 the exact
    construction (ml_dtypes rounds float64 -> bfloat16 through float32)."""
    dt = np.dtype(dt)
    x = np.asarray(x, dtype=F64)
    if dt in (F64, F32, F16):
        return x.astype(dt)
    return round_f64_exact(x, dt)


@_quiet
def round_f64_exact(x, dt):
    """round_f64 from first principles: divide by the ulp of the binade
    (exact), np.rint (half to even), multiply back, overflow to inf."""
    dt = np.dtype(dt)
    x = np.asarray(x, dtype=F64)
    if dt == F64:
        return x.copy()
    p, emin, _ = _FORMAT[dt]
    with np.errstate(all="ignore"):
        _, ex = np.frexp(x)               # |x| = m * 2**ex, m in [0.5, 1)
        e = np.maximum(ex.astype(np.int64) - 1, emin)
        q = np.ldexp(1.0, (e - p + 1).astype(np.int32))   # ulp of the binade
        y = np.rint(x / q) * q
        big = np.isfinite(x) & (np.abs(y) > _max_finite(dt))
        y = np.where(big, np.copysign(np.inf, x), y)
        y = np.where(np.isfinite(x), y, x)   # inf, nan as they are
    out = y.astype(dt)   # exact: y is representable in dt
    return out


def widen(a, cdt):
    """Exact widening (float16/bfloat16/float32 -> float32 or float64)."""
    return np.asarray(a).astype(cdt)


@_quiet
def accumulate_ref(acc, grad):
    """acc + grad per the contract, as a new array of acc's dtype/shape."""
    acc = np.asarray(acc)
    grad = np.asarray(grad).reshape(acc.shape)
    cdt = compute_dtype(acc.dtype, grad.dtype)
    with np.errstate(all="ignore"):
        s = widen(acc, cdt) + widen(grad, cdt)   # one IEEE add in cdt
    return round_f64(s.astype(F64), acc.dtype)


@_quiet
def overwrite_ref(acc, grad):
    """grad's values in acc's dtype and shape, rounded once."""
    acc = np.asarray(acc)
    grad = np.asarray(grad).reshape(acc.shape)
    return round_f64(grad.astype(F64), acc.dtype)


@_quiet
def scale_ref(x, factor):
    x = np.asarray(x)
    cdt = compute_dtype(x.dtype)
    with np.errstate(all="ignore"):
        p = widen(x, cdt) * cdt.type(factor)
    return round_f64(p.astype(F64), x.dtype)


@_quiet
def all_finite_ref(tensors):
    return all(bool(np.all(np.isfinite(np.asarray(t).astype(F64))))
               for t in tensors)


@_quiet
def same_bits(got, ref):
    """None if equal (bitwise; NaN matches NaN), else a short description."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return "dtype/shape %s %s, expected %s %s" % (
            got.dtype, got.shape, ref.dtype, ref.shape)
    gu = uint_view(got).reshape(-1)
    ru = uint_view(ref).reshape(-1)
    bad = gu != ru
    if not bad.any():
        return None
    g64 = got.reshape(-1).astype(F64)
    r64 = ref.reshape(-1).astype(F64)
    bad &= ~(np.isnan(g64) & np.isnan(r64))
    if not bad.any():
        return None
    idx = np.flatnonzero(bad)
    w = got.dtype.itemsize * 2
    samples = ["[%d] got %r (0x%0*x) expected %r (0x%0*x)" % (
        i, g64[i].item(), w, int(gu[i]), r64[i].item(), w, int(ru[i]))
        for i in idx[:4]]
    return "%d of %d elements differ: %s" % (idx.size, gu.size,
                                             "; ".join(samples))


@_quiet
def describe_pair(acc, grad, idx):
    acc = np.asarray(acc).reshape(-1)
    grad = np.asarray(grad).reshape(-1)
    return ", ".join("acc[%d]=%r (%s) grad[%d]=%r (%s)" % (
        i, float(acc[i]), acc.dtype, i, float(grad[i]), grad.dtype)
        for i in idx[:4])


@_quiet
def first_bad(got, ref):
    gu = uint_view(got).reshape(-1)
    ru = uint_view(ref).reshape(-1)
    bad = gu != ru
    bad &= ~(np.isnan(np.asarray(got).reshape(-1).astype(F64))
             & np.isnan(np.asarray(ref).reshape(-1).astype(F64)))
    return np.flatnonzero(bad)


def all_patterns(dt):
    """Every bit pattern of a 16-bit dtype, as an array of that dtype."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dt)


# -------------------------------------------------------------- random inputs

@_quiet
def random_floats(rng, n, dt, kind="normal"):
    """n values of dtype dt.

    normal: N(0, 4^2); wide: sign * 2**U(-30, 30) * U(1, 2) (sums that
    round at every magnitude); bits: uniformly random bytes (NaN, inf,
    subnormals included); small: integers in [-8, 8]."""
    dt = np.dtype(dt)
    if kind == "bits":
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        return raw.view(dt).copy()
    if kind == "small":
        return rng.integers(-8, 8, size=n, endpoint=True).astype(dt)
    if kind == "wide":
        lim = 14 if dt == F16 else 30
        v = (rng.choice([-1.0, 1.0], size=n) * rng.uniform(1, 2, size=n)
             * np.exp2(rng.integers(-lim, lim, size=n, endpoint=True)))
    else:
        v = rng.standard_normal(n) * 4.0
    if dt == BF16:
        return round_f64(v, BF16)
    return v.astype(dt)


@_quiet
def near_pairs(rng, n, acc_dt, grad_dt):
    """acc, grad with grad close to -acc or to a small multiple of acc's ulp:
    cancellation and ties."""
    acc = random_floats(rng, n, acc_dt, "wide")
    a64 = acc.astype(F64)
    p = _FORMAT.get(np.dtype(acc_dt), (53, 0, 0))[0]
    ulp = np.abs(a64) * 2.0 ** (1 - p)
    k = rng.integers(-6, 6, size=n, endpoint=True) * 0.5
    g = np.where(rng.random(n) < 0.5, -a64 + k * ulp, k * ulp)
    return acc, round_f64(g, grad_dt) if np.dtype(grad_dt) != F64 else g


# ------------------------------------------- workload for the SIMD comparison

SIMD_SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 4099]


def simd_workload(seed=20240611):
    """Deterministic inputs for the SIMD-vs-portable comparison: a list of
    (name, kind, arrays...) with kind in accumulate/overwrite/scale/
    all_finite/fused."""
    rng = np.random.default_rng(seed)
    work = []
    for adt in FLOATS:
        for gdt in FLOATS:
            for n in SIMD_SIZES:
                for kind in ("normal", "wide", "bits"):
                    a = random_floats(rng, n, adt, kind)
                    g = random_floats(rng, n, gdt, kind)
                    work.append(("acc/%s/%s/%d/%s" % (adt, gdt, n, kind),
                                 "accumulate", a, g))
            a, g = near_pairs(rng, 2048, adt, gdt)
            work.append(("acc/%s/%s/near" % (adt, gdt), "accumulate", a, g))
            g = random_floats(rng, 1037, gdt, "bits")
            a = random_floats(rng, 1037, adt, "normal")
            work.append(("ovw/%s/%s" % (adt, gdt), "overwrite", a, g))
        for kind in ("normal", "wide", "bits"):
            x = random_floats(rng, 2053, adt, kind)
            for f in (0.1, -3.0, 1e-3):
                work.append(("scale/%s/%s/%r" % (adt, kind, f), "scale", x,
                             np.array(f)))
    # 16-bit exhaustive grads against a few accumulators
    for gdt in (F16, BF16):
        g = all_patterns(gdt)
        for adt in FLOATS:
            a = random_floats(rng, g.size, adt, "wide")
            work.append(("exh/%s/%s" % (adt, gdt), "accumulate", a, g))
    # all_finite over a range of positions
    for dt in FLOATS:
        for n in (1, 7, 8, 9, 16, 17, 1023):
            for pos in sorted({0, n // 2, n - 1}):
                for bad in (np.nan, np.inf, -np.inf):
                    x = np.ones(n, dtype=dt)
                    x[pos] = bad
                    work.append(("fin/%s/%d/%d/%r" % (dt, n, pos, bad),
                                 "all_finite", x))
    # one fused call: 40 mixed pairs
    accs, grads = [], []
    for _ in range(40):
        n = int(rng.choice([0, 1, 5, 8, 13, 64, 333, 1500]))
        accs.append(random_floats(rng, n, FLOATS[rng.integers(4)], "wide"))
        grads.append(random_floats(rng, n, FLOATS[rng.integers(4)], "wide"))
    work.append(("fused", "fused", accs, grads))
    return work


def run_workload(gs, work):
    """Run ``simd_workload`` through gradsync; {name: result array}."""
    out = {}
    for item in work:
        name, kind = item[0], item[1]
        assert name not in out, "duplicate workload name " + name
        if kind == "accumulate":
            a = item[2].copy()
            gs.accumulate_(a, item[3])
            out[name] = a
        elif kind == "overwrite":
            a = item[2].copy()
            gs.accumulate_v2_(a, item[3], overwrite=True)
            out[name] = a
        elif kind == "scale":
            x = item[2].copy()
            gs.scale_(x, float(item[3]))
            out[name] = x
        elif kind == "all_finite":
            out[name] = np.array(bool(gs.all_finite(item[2])))
        elif kind == "fused":
            accs = [a.copy() for a in item[2]]
            gs.accumulate_(accs, item[3])
            for i, a in enumerate(accs):
                out["%s/%d" % (name, i)] = a
    return out


# ----------------------------------------------------------------- self check

def self_check():
    """Validate round_f64 against casts known to round once, and against
    exact rational arithmetic on hard cases.  Returns a list of problems."""
    from fractions import Fraction
    problems = []
    rng = np.random.default_rng(1)
    # float32 values of every kind -> float16 (numpy: single rounding)
    x32 = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(
        np.uint32).view(F32)
    with np.errstate(all="ignore"):
        msg = same_bits(round_f64_exact(x32.astype(F64), F16), x32.astype(F16))
    if msg:
        problems.append("f32->f16: " + msg)
    # float32 -> bfloat16 (ml_dtypes: single rounding from float32)
    msg = same_bits(round_f64_exact(x32.astype(F64), BF16), x32.astype(BF16))
    if msg:
        problems.append("f32->bf16: " + msg)
    # float64 of every magnitude -> float16 (numpy rounds double->half once)
    x64 = rng.integers(0, 1 << 63, size=1 << 18, dtype=np.int64).view(F64)
    x64 = np.concatenate([x64, -x64, rng.standard_normal(1 << 16) * 1e4])
    with np.errstate(all="ignore"):
        msg = same_bits(round_f64_exact(x64, F16), x64.astype(F16))
    if msg:
        problems.append("f64->f16: " + msg)
    with np.errstate(all="ignore"):
        msg = same_bits(round_f64_exact(x64, F32), x64.astype(F32))
    if msg:
        problems.append("f64->f32: " + msg)

    # exact rational rounding on ties and near-ties
    def exact_round(fr, dt):
        p, emin, emax = _FORMAT[dt]
        if fr == 0:
            return 0.0
        s = -1 if fr < 0 else 1
        a = abs(fr)
        e = a.numerator.bit_length() - a.denominator.bit_length()
        if Fraction(2) ** e > a:
            e -= 1
        e = max(e, emin)
        q = Fraction(2) ** (e - p + 1)
        n = a / q
        fl = n.numerator // n.denominator
        rem = n - fl
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2):
            fl += 1
        v = fl * q
        if v > Fraction(_max_finite(dt)):
            return s * float("inf")
        return s * float(v)

    cases = []
    for dt in (F16, BF16, F32):
        p, emin, emax = _FORMAT[dt]
        for e in (emin - 3, emin, 0, 3, emax):
            for k in range(0, 9):
                for tweak in (Fraction(0), Fraction(1, 2 ** 40),
                              -Fraction(1, 2 ** 40)):
                    base = Fraction(2) ** e * (1 + Fraction(k, 2 ** p))
                    cases.append((dt, base * (1 + tweak)))
        top = Fraction(_max_finite(dt))
        half = Fraction(2) ** (emax - p)
        for t in (top + half, top + half - half / 1024, top + half / 2):
            cases.append((dt, t))
    for dt, fr in cases:
        x = float(fr)
        if Fraction(x) != fr:
            continue  # not a float64; skip
        got = float(round_f64_exact(np.array([x]), dt).astype(F64)[0])
        got2 = float(round_f64(np.array([x]), dt).astype(F64)[0])
        if got2 != got:
            problems.append("fast %s %r: %r vs %r" % (dt, x, got2, got))
        want = exact_round(fr, dt)
        if got != want:
            problems.append("exact %s %r: got %r want %r" % (dt, x, got, want))
    return problems


if __name__ == "__main__":
    probs = self_check()
    print("\n".join(probs) if probs else "kernel_reference self_check: ok")
