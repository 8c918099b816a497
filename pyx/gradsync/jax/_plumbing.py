"""gradsync.jax's plumbing outside jit: pytrees of JAX arrays to gradsync's
arguments (DLPack, no copy) and gradsync-owned results back to JAX arrays
(DLPack, no copy)."""
import jax

import gradsync as gs
from gradsync import _core


def _leaves(tree, what):
    """(leaves, treedef, paths) of a pytree of JAX arrays; tracers refused."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, paths = [], []
    for path, leaf in pairs:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{where} is a JAX tracer: gradsync.jax's kernels run outside jax.jit, on "
                "concrete arrays (its collectives take tracers)")
        if not isinstance(leaf, jax.Array):
            raise TypeError(f"{where} must be a jax.Array, got {type(leaf).__name__}")
        leaves.append(leaf)
        paths.append(where)
    return leaves, treedef, paths


def _named(paths, call, *args, label="tensors"):
    """call(*args), with the pytree path of each leaf the error names
    ('tensors[3]' is "x['w']")."""
    try:
        return call(*args)
    except Exception as exc:
        text = str(exc)
        hits = [f"{label}[{i}] is {p}" for i, p in enumerate(paths) if f"{label}[{i}]" in text]
        if hits:
            exc.add_note("(" + "; ".join(hits) + ")")
        raise


def _to_jax(out):
    """A JAX array viewing gradsync's result (never a copy: the memory is
    64-byte aligned host memory or CUDA memory)."""
    return jax.dlpack.from_dlpack(out, copy=False)


def _answer(treedef, outs):
    return jax.tree_util.tree_unflatten(treedef, [_to_jax(o) for o in outs])


def _device(leaf):
    """The DeviceArray device of a leaf's memory: its CUDA device, else host."""
    kind, ordinal = leaf.__dlpack_device__()
    return (int(kind), int(ordinal)) if int(kind) == _core.DLPACK_CUDA else "cpu"


def _empty_like(leaf, shape):
    """gradsync-owned memory for a result: 64-byte aligned host memory or the
    leaf's CUDA device, which JAX takes through DLPack without a copy."""
    return gs.DeviceArray(shape, leaf.dtype, _device(leaf))


def _new_like(leaves, paths, copy=False):
    """_empty_like of each leaf's shape (checked by gradsync first, so errors
    name the leaf), holding its values with ``copy``."""
    views = _named(paths, _core.views, leaves)  # each leaf read once
    outs = [_empty_like(leaf, view.shape) for leaf, view in zip(leaves, views)]
    if copy:
        for out, view in zip(outs, views):
            _core.copy_(out, view)
    return outs


def _copies(leaves, paths):
    """gradsync-owned copies of the leaves, each on its leaf's device."""
    outs = []
    for leaf, where in zip(leaves, paths):
        try:
            outs.append(gs.DeviceArray.from_numpy(leaf, device=_device(leaf)))
        except Exception as exc:
            exc.add_note(f"(arr is {where})")
            raise
    return outs
