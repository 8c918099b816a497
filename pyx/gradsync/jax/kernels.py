"""gradsync.jax's gradient kernels, outside jit: out-of-place versions of
gradsync's kernels on pytrees of JAX arrays."""
import gradsync as gs
from gradsync.jax._plumbing import _answer, _copies, _leaves, _named


def accumulate(acc, grad):
    """``acc + grad`` as new arrays in acc's dtypes, pairwise over two pytrees
    of one structure: added in float32 (float64 if either side is) and
    rounded once, as ``gs.accumulate_`` (a float16/bfloat16 accumulator gains
    what a cast-then-add would round away)."""
    acc_leaves, treedef, paths = _leaves(acc, "acc")
    grad_leaves, grad_def, grad_paths = _leaves(grad, "grad")
    if grad_def != treedef:
        raise ValueError(f"acc and grad must have one pytree structure: {treedef} vs "
                         f"{grad_def}")
    outs = _copies(acc_leaves, paths)
    _named(grad_paths, gs.accumulate_, outs, grad_leaves, label="grad")
    return _answer(treedef, outs)


def scale(x, factor):
    """``x * factor`` as new arrays: float32 arithmetic (float64 for float64
    arrays), rounded once, as ``gs.scale_``."""
    leaves, treedef, paths = _leaves(x, "x")
    outs = _copies(leaves, paths)
    _named(paths, gs.scale_, outs, float(factor))
    return _answer(treedef, outs)


def all_finite(x):
    """True when no element of any array of ``x`` is NaN or infinite (one
    fused pass, no copy)."""
    leaves, _, paths = _leaves(x, "x")
    return _named(paths, gs.all_finite, leaves)
