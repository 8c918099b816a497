"""gradsync.jax: collectives and gradient kernels that take and return JAX
arrays, outside ``jax.jit`` and (the collectives) inside it.

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

Inside ``jax.jit`` (and ``jax.grad``, ``vmap``, ``lax.scan``,
``lax.cond``) the collectives lower to XLA FFI custom calls that run
gradsync's C collectives on the buffers XLA hands them (CPU), in program
order on every rank, with results bitwise equal to the same call outside
jit; the whole training step can be one jitted function::

    @jax.jit
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        grads = gsj.allreduce(grads, comm, op="average")  # one fused call
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

Inside jit, allgather needs every rank's arrays to have one shape, error
feedback (``residual``) is refused, and an error raised by a collective
reaches Python as JAX's runtime error naming gradsync's status:
``gsj.checked(step)`` re-raises it as gradsync's error class. jax.grad
works through allreduce and reduce_scatter with op sum or average,
broadcast and allgather (docs/GUIDE.md, JAX). ``comm`` defaults to one
gs.Communicator over COMM_WORLD shared with gradsync.torch. Every
collective is collective: every rank calls it, with the same pytree
structure, in the same order.

``import gradsync`` never imports jax; this module does, and fails at
import on a JAX outside SUPPORTED_JAX.
"""
import re

import jax

# [oldest, first unsupported): gradsync.jax's lowering uses jax.ffi (0.5 on)
# and JAX's ordered effects, which have no public API (docs/decisions/jax.md)
SUPPORTED_JAX = ((0, 5), (0, 11))


def _version_problem(version):
    """None when JAX `version` ("0.10.2") is supported, else why not."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    (lo, hi) = SUPPORTED_JAX
    if lo <= numbers < hi:
        return None
    return (f"gradsync.jax supports JAX {lo[0]}.{lo[1]} up to (not including) {hi[0]}.{hi[1]}, "
            f"found JAX {version}: install a JAX in that range (pip install 'jax>={lo[0]}.{lo[1]},"
            f"<{hi[0]}.{hi[1]}'), or a gradsync made for your JAX")


if _version_problem(jax.__version__):
    raise ImportError(_version_problem(jax.__version__))

import gradsync as gs  # noqa: E402
from gradsync import _core  # noqa: E402
from gradsync.communicator import default_communicator  # noqa: E402
from gradsync.jax import _traced  # noqa: E402

__all__ = ["SUPPORTED_JAX", "adasum", "accumulate", "all_finite", "allgather", "allreduce",
           "broadcast", "checked", "gradsync_error", "jit_available", "reduce_scatter", "scale"]


# ---------------------------------------------------------------- plumbing

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


def _is_traced(x):
    """True when some leaf of x is a tracer: the call lowers into the traced
    program. Otherwise collectives launched by earlier jitted calls finish
    first (JAX dispatches asynchronously; gradsync's calls must reach every
    rank in one order)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x)):
        return True
    if _traced_calls_made[0]:
        jax.effects_barrier()
    return False


_traced_calls_made = [False]  # effects_barrier() only once something was traced


def _lowered(x, comm, kind, **attrs):
    _traced_calls_made[0] = True
    return _traced.call(x, "x", comm, kind, **attrs)


def jit_available():
    """None when the collectives work inside jax.jit, else why not (a
    sentence: the handlers were not built, or could not be loaded)."""
    return _traced.unavailable()


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
    if _is_traced(x):
        if residual is not None:
            raise TypeError("gradsync.jax.allreduce inside jax.jit takes no residual (error "
                            "feedback keeps state between calls): call it outside jit")
        return _lowered(x, comm, "allreduce", op=_traced.op_code(op, adasum),
                        prescale=float(prescale), postscale=float(postscale),
                        wire=_traced.wire_code(wire))
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
    if _is_traced(x):
        return _lowered(x, comm, "broadcast", root=int(root))
    leaves, treedef, paths = _leaves(x, "x")
    outs = comm._checked(lambda: _new_like(leaves, paths, copy=True))
    _named(paths, comm.handle.broadcast, outs, int(root))
    return _answer(treedef, outs)


def allgather(x, comm=None):
    """Each array of ``x`` concatenated over ranks along dim 0 (dim 0 may
    differ by rank)."""
    comm = default_communicator(comm)
    if _is_traced(x):
        return _lowered(x, comm, "allgather")
    leaves, treedef, paths = _leaves(x, "x")
    outs = _named(paths, comm._allgather, leaves, _empty_like)
    return _answer(treedef, outs)


def reduce_scatter(x, comm=None, op="sum", *, prescale=1.0, postscale=1.0):
    """Rank r's block of dim 0 of each array's reduction: ``n // size +
    (r < n % size)`` rows."""
    comm = default_communicator(comm)
    if _is_traced(x):
        return _lowered(x, comm, "reduce_scatter", op=_traced.op_code(op, None),
                        prescale=float(prescale), postscale=float(postscale))
    leaves, treedef, paths = _leaves(x, "x")
    outs = _named(paths, comm._reduce_scatter, leaves, op, float(prescale), float(postscale),
                  _empty_like)
    return _answer(treedef, outs)


# ------------------------------------------------------------------ errors

def gradsync_error(exc):
    """The gradsync error (gs.MismatchError, gs.TimeoutError, ...) that JAX's
    runtime error ``exc`` carries from a collective inside jax.jit, or None
    when it carries none. Its message names the operation."""
    return _traced.gradsync_error(exc)


def checked(fn):
    """``fn`` (a jitted function) that waits for its results and raises a
    failed gradsync collective inside it as gradsync's error class, with
    JAX's runtime error as its cause."""
    def run(*args, **kwargs):
        try:
            return jax.block_until_ready(fn(*args, **kwargs))
        except Exception as exc:
            err = gradsync_error(exc)
            if err is None:
                raise
            raise err from exc
    run.__doc__, run.__name__ = fn.__doc__, getattr(fn, "__name__", "checked")
    run.__wrapped__ = fn
    return run


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

