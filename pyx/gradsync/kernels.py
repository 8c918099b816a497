"""Gradient control kernels: the host-side work around the collectives of a
training step (docs/GUIDE.md section 2.8). Each takes one array or a list (lists of
pairs for the accumulators) and runs as one fused pass in C."""
from gradsync import _core


def zero_(tensors):
    """Sets every element of every tensor to +0.0 (bit pattern 0), any dtype.
    NaN and inf are cleared too. Returns what it was given."""
    _core.zero_(tensors)
    return tensors


def accumulate_(acc, grad, do_update=True):
    """acc += grad in place; returns acc.

    Floating dtypes (float16, bfloat16, float32, float64) in any pairing;
    computed in float32 (float64 when either side is float64) and rounded once
    to acc's dtype. Lists of acc and of grad are accumulated pairwise in one
    fused pass; each pair needs equal element counts (shapes may differ).
    With ``do_update=False`` acc is left alone and grad is not read."""
    _core.accumulate_(acc, grad, False, bool(do_update))
    return acc


def accumulate_v2_(acc, grad, overwrite=False):
    """ONNX Runtime's InPlaceAccumulatorV2: with ``overwrite`` acc takes grad's
    values (cast, rounded once), otherwise acc += grad. Returns (True, acc)."""
    _core.accumulate_(acc, grad, bool(overwrite), True)
    return True, acc


def all_finite(tensors):
    """True when no element of any tensor is NaN or infinite."""
    return _core.all_finite(tensors)


def scale_(tensors, factor):
    """Multiplies every element by ``factor`` in place: float32 arithmetic
    (float64 for float64 tensors), rounded once. Floating dtypes only.
    Returns what it was given."""
    _core.scale_(tensors, float(factor))
    return tensors
