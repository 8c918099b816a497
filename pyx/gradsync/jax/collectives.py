"""gradsync.jax's collectives: outside jit on concrete arrays (zero copy),
inside it lowered to XLA FFI calls (_traced, _jit); and the mapping of a
failed collective inside jit onto gradsync's errors."""
import jax

from gradsync.communicator import default_communicator
from gradsync.jax._plumbing import _answer, _empty_like, _leaves, _named, _new_like
from gradsync.jax._traced import call, op_code, unavailable, wire_code
from gradsync.jax._traced import gradsync_error as _gradsync_error


def _is_traced(x):
    """True when some leaf of x is a tracer: the call lowers into the traced
    program. Otherwise collectives launched by earlier jitted calls finish
    first (JAX dispatches asynchronously; gradsync's calls must reach every
    rank in one order)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x)):
        return True
    if _TRACED_CALLS_MADE[0]:
        jax.effects_barrier()
    return False


_TRACED_CALLS_MADE = [False]  # effects_barrier() only once something was traced


def _lowered(x, comm, kind, **attrs):
    _TRACED_CALLS_MADE[0] = True
    return call(x, "x", comm, kind, **attrs)


def jit_available():
    """None when the collectives work inside jax.jit, else why not (a
    sentence: the handlers were not built, or could not be loaded)."""
    return unavailable()


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
        return _lowered(x, comm, "allreduce", op=op_code(op, adasum),
                        prescale=float(prescale), postscale=float(postscale),
                        wire=wire_code(wire))
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


def alltoall(x, comm=None):
    """Block r of dim 0 of each array of ``x`` goes to rank r; each result
    holds the blocks it got, in rank order, with the array's shape. Dim 0
    must divide by the rank count (equal blocks: the shapes are known where
    jax.jit traces); inside jit every rank's arrays must have one shape."""
    comm = default_communicator(comm)
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] % comm.size:
            raise ValueError(f"gradsync.jax.alltoall: x{jax.tree_util.keystr(path)} has shape "
                             f"{shape}: dim 0 must be a multiple of the rank count ({comm.size})")
    if _is_traced(x):
        return _lowered(x, comm, "alltoall")
    leaves, treedef, paths = _leaves(x, "x")
    outs = [_empty_like(leaf, leaf.shape) for leaf in leaves]
    _named(paths, lambda: comm.alltoall(leaves, out=outs) if leaves else None)
    return _answer(treedef, outs)


def reduce_scatter(x, comm=None, op="sum", *, prescale=1.0, postscale=1.0):
    """Rank r's block of dim 0 of each array's reduction: ``n // size +
    (r < n % size)`` rows."""
    comm = default_communicator(comm)
    if _is_traced(x):
        return _lowered(x, comm, "reduce_scatter", op=op_code(op, None),
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
    return _gradsync_error(exc)


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
