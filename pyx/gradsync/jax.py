"""gradsync.jax: collectives and gradient kernels that take and return JAX
arrays, for training loops that call them outside ``jax.jit``.

JAX arrays are immutable, so every call here is out of place: it reads its
inputs where they are (DLPack, no copy), writes the results into memory
gradsync allocates (64-byte aligned host memory, or the inputs' CUDA device)
and hands that memory to JAX through DLPack without a copy. Each call takes
a pytree of arrays (one array, a list, a dict of parameters...) and returns
the same structure; a pytree is one fused call::

    import gradsync as gs
    import gradsync.jax as gsj

    comm = gs.Communicator()
    params = gsj.broadcast(params, comm, root=0)
    for batch in shard:
        grads = grad_fn(params, batch)                  # jitted, per rank
        grads = gsj.allreduce(grads, comm, op="average")
        params = update(params, grads)                  # jitted

Inside ``jax.jit`` there are no buffers to hand over (the arguments are
tracers), and these calls refuse them; use JAX's own collectives there
(``jax.lax.psum`` under ``shard_map``), or call gradsync between jitted
functions as above. ``comm`` defaults to one gs.Communicator over
COMM_WORLD shared with gradsync.torch. Every collective is collective:
every rank calls it, with the same pytree structure, in the same order.

``import gradsync`` never imports jax; this module does.
"""
import jax

import gradsync as gs
from gradsync import _core
from gradsync.communicator import default_communicator

__all__ = ["adasum", "accumulate", "all_finite", "allgather", "allreduce", "broadcast",
           "reduce_scatter", "scale"]


# ---------------------------------------------------------------- plumbing

def _leaves(tree, what):
    """(leaves, treedef, paths) of a pytree of JAX arrays; tracers refused."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, paths = [], []
    for path, leaf in pairs:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{where} is a JAX tracer: gradsync.jax runs outside jax.jit, on concrete "
                "arrays. Inside jit use JAX's collectives (jax.lax.psum under shard_map), or "
                "return the values from the jitted function and call gradsync on them")
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


# ------------------------------------------------------------- collectives

def allreduce(x, comm=None, op="sum", *, prescale=1.0, postscale=1.0, adasum=None,
              wire=None, residual=None):
    """The reduction over ranks of every array of the pytree ``x``, as new
    JAX arrays in the same structure (one fused call). ``op``: "sum",
    "average", "min", "max", "prod" or "adasum"; prescale and postscale as
    in ``Communicator.allreduce``. ``wire``: a wire format ("bfloat16",
    "float16", "float8_e4m3", "float8_e5m2"; sum and average of float32
    leaves, and bfloat16/float16 leaves for the float8 formats): the leaves
    cross the network in it, summed in float32 and rounded once
    (docs/GUIDE.md section 2.15); ``residual``: a ``gs.ErrorFeedback`` kept
    from step to step (its float32 residuals are host arrays: a JAX array
    cannot be written in place), or a list of float32 NumPy arrays, one per
    leaf in ``jax.tree_util.tree_leaves`` order."""
    comm = default_communicator(comm)
    leaves, treedef, paths = _leaves(x, "x")
    outs = comm._checked(lambda: _new_like(leaves, paths))  # a bad leaf: others fail too
    if residual is not None and hasattr(residual, "residuals"):
        residual = comm._checked(lambda: residual.residuals(leaves))
    _named(paths, comm.handle.allreduce, leaves, outs, op, float(prescale), float(postscale),
           adasum, wire, residual)
    return _answer(treedef, outs)


def adasum(x, comm=None, *, prescale=1.0, postscale=1.0, hierarchical=False):
    """Adasum over ranks of every array of ``x`` (per array: docs/GUIDE.md
    section 5): ``allreduce(x, comm, op="adasum")``; ``hierarchical`` averages inside
    each node first (GPUs)."""
    return allreduce(x, comm, "adasum", prescale=prescale, postscale=postscale,
                     adasum="hierarchical" if hierarchical else "flat")


def broadcast(x, comm=None, root=0):
    """``root``'s arrays on every rank, as new JAX arrays (``x`` gives each
    rank's shapes and dtypes, which must match root's)."""
    comm = default_communicator(comm)
    leaves, treedef, paths = _leaves(x, "x")
    outs = comm._checked(lambda: _new_like(leaves, paths, copy=True))
    _named(paths, comm.handle.broadcast, outs, int(root))
    return _answer(treedef, outs)


def allgather(x, comm=None):
    """Each array of ``x`` concatenated over ranks along dim 0 (dim 0 may
    differ by rank)."""
    comm = default_communicator(comm)
    leaves, treedef, paths = _leaves(x, "x")
    outs = _named(paths, comm._allgather, leaves, _empty_like)
    return _answer(treedef, outs)


def reduce_scatter(x, comm=None, op="sum", *, prescale=1.0, postscale=1.0):
    """Rank r's block of dim 0 of each array's reduction: ``n // size +
    (r < n % size)`` rows."""
    comm = default_communicator(comm)
    leaves, treedef, paths = _leaves(x, "x")
    outs = _named(paths, comm._reduce_scatter, leaves, op, float(prescale), float(postscale),
                  _empty_like)
    return _answer(treedef, outs)


# ------------------------------------------------------------------ kernels

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

