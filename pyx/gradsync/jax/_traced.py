"""gradsync.jax's collectives on tracers (inside jax.jit, grad, vmap, scan,
cond): the pytree's leaves go to one call of _jit's primitive (one fused
call), wrapped in a custom_vjp that says what each collective's transpose is
(docs/decisions/jax.md):

- allreduce, op sum or average: the same allreduce of the cotangents (the
  map x -> c * sum_r x_r is its own transpose);
- broadcast: the cotangents summed over ranks, kept on the root, zero elsewhere;
- allgather: reduce_scatter (sum) of the cotangents;
- reduce_scatter, op sum or average: allgather of the cotangents, scaled
  (every rank's block of one size: dim 0 a multiple of the rank count);
- alltoall (equal blocks): the same alltoall of the cotangents (block s of
  rank r's result is block r of rank s's input: the permutation is its own
  transpose).

min, max, prod, Adasum and wire formats have no gradient here: jax.grad
through them raises.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from gradsync import _core
from gradsync.jax import _jit
from gradsync.wire import WIRES

DTYPES = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int8", "uint8", "int32",
                                       "int64")) + (jnp.dtype(jnp.bfloat16),)
LINEAR_OPS = (_core.OPS["sum"], _core.OPS["average"])


def unavailable():
    return _jit.UNAVAILABLE


_STATUS = re.compile(r"\[gradsync status=(\d+)\] ")


def gradsync_error(exc):
    """gradsync's error for JAX's runtime error `exc`, or None."""
    found = _STATUS.search(str(exc))
    if not found or not isinstance(exc, Exception):
        return None
    message = str(exc)[found.end():].strip()
    return _core.error_of_status(int(found.group(1)), message)


def available():
    """Raises TypeError saying why, when jit support was not built or loaded."""
    if _jit.UNAVAILABLE:
        raise TypeError("gradsync.jax got a JAX tracer (inside jax.jit, grad, vmap or scan), "
                        f"but its collectives inside jit are unavailable: {_jit.UNAVAILABLE}")


def leaves_of(tree, what, kind):
    """(leaves as JAX values, treedef): every leaf an array of a dtype gradsync
    reduces, with dim 0 where the collective needs one."""
    available()
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in pairs:
        where = f"{what}{jax.tree_util.keystr(path)}"
        leaf = jnp.asarray(leaf)
        if leaf.dtype not in DTYPES:
            raise TypeError(f"gradsync.jax.{kind}: {where} has dtype {leaf.dtype}, which "
                            "gradsync does not reduce")
        if kind in ("allgather", "reduce_scatter", "alltoall") and leaf.ndim == 0:
            raise ValueError(f"gradsync.jax.{kind}: {where} is a scalar; it needs a dim 0")
        leaves.append(leaf)
    return leaves, treedef


def op_code(op, adasum):
    code = _core.OPS.get(op.lower()) if isinstance(op, str) else \
        (int(op) if int(op) in _core.OPS.values() else None)
    if code is None:
        raise ValueError(f"op must be one of {', '.join(_core.OPS)} (or gradsync.Op), got {op!r}")
    if adasum not in (None, "flat", "hierarchical"):
        raise ValueError(f"adasum must be 'flat' or 'hierarchical', got {adasum!r}")
    if code == _core.OPS["adasum"] and adasum == "hierarchical":
        code = _core.OPS["adasum_hierarchical"]
    return code


def wire_code(wire):
    if wire is None:
        return 0
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)} or None, got {wire!r}")
    return WIRES.index(wire) + 1  # gs_wire_t: GS_WIRE_NONE, then WIRES' order


def spec(comm, kind, **attrs):
    """What one call is, hashable: custom_vjp's nondifferentiable argument."""
    return (kind, int(comm.c_handle), comm.size, comm.rank, tuple(sorted(attrs.items())))


def _bind(sp, leaves):
    kind, handle, size, rank, attrs = sp
    return tuple(_jit.collective_p.bind(*leaves, kind=kind, comm=handle, size=size, rank=rank,
                                        attrs=attrs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def collective(sp, *leaves):
    """The collective `sp` of the leaves: a tuple of results."""
    return _bind(sp, leaves)


def _fwd(sp, *leaves):
    return _bind(sp, leaves), None


def _bwd(sp, _, cts):
    kind, handle, size, rank, attrs = sp
    a = dict(attrs)
    cts = [jnp.zeros(c.shape, c.dtype) if type(c).__name__ == "Zero" else c for c in cts]
    if kind == "allreduce":
        if a["op"] not in LINEAR_OPS or a["wire"]:
            raise TypeError("jax.grad through gradsync.jax.allreduce needs op 'sum' or "
                            "'average' without a wire format (its transpose is the same "
                            "allreduce); min, max, prod and Adasum have no gradient here")
        return _bind(sp, cts)
    if kind == "broadcast":
        summed = _bind(("allreduce", handle, size, rank, (("op", LINEAR_OPS[0]),
                        ("postscale", 1.0), ("prescale", 1.0), ("wire", 0))), cts)
        return tuple(s if rank == a["root"] else jnp.zeros_like(s) for s in summed)
    if kind == "alltoall":
        return _bind(sp, cts)
    if kind == "allgather":
        return _bind(("reduce_scatter", handle, size, rank,
                      (("op", LINEAR_OPS[0]), ("postscale", 1.0), ("prescale", 1.0))), cts)
    if a["op"] not in LINEAR_OPS:  # reduce_scatter
        raise TypeError("jax.grad through gradsync.jax.reduce_scatter needs op 'sum' or "
                        "'average' (its transpose is an allgather)")
    scale = a["prescale"] * a["postscale"] / (size if a["op"] == LINEAR_OPS[1] else 1)
    gathered = _bind(("allgather", handle, size, rank, ()), cts)
    return tuple(g * jnp.asarray(scale, g.dtype) for g in gathered)


collective.defvjp(_fwd, _bwd)


def call(tree, what, comm, kind, **attrs):
    """The collective on the pytree `tree`, as a pytree of the same structure."""
    leaves, treedef = leaves_of(tree, what, kind)
    outs = collective(spec(comm, kind, **attrs), *leaves) if leaves else ()
    return jax.tree_util.tree_unflatten(treedef, list(outs))
