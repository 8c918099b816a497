"""gradsync's collectives inside jax.jit: one JAX primitive whose calls lower
to the XLA FFI handlers of libgradsync_jax.so (_ffi.cc), with an ordered
effect so that XLA runs them in program order on every rank
(docs/decisions/jax.md).

JAX has no public API for ordered effects, custom calls that take tokens or
a primitive's eager implementation: those come from ``jax._src`` here and
nowhere else in gradsync, which is why gradsync.jax checks the JAX version at
import (SUPPORTED_JAX). The primitive is linear in its inputs for the sum and
average reductions, broadcast, allgather, reduce_scatter and alltoall; gradsync.jax's
custom_vjp rules use that, the primitive itself has no JVP.
"""
import ctypes
import os

import numpy as np
from jax._src import dispatch, effects
from jax._src.interpreters import mlir as _mlir
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgradsync_jax.so")
TARGETS = {"allreduce": "GsJaxAllreduce", "broadcast": "GsJaxBroadcast",
           "allgather": "GsJaxAllgather", "reduce_scatter": "GsJaxReduceScatter",
           "alltoall": "GsJaxAlltoall"}


class GradsyncEffect(effects.Effect):
    """gradsync's collectives: ordered, so a program's calls keep their order."""

    def __str__(self):
        return "gradsync"


EFFECT = GradsyncEffect()
for _kind in (effects.ordered_effects, effects.lowerable_effects,
              effects.control_flow_allowed_effects, effects.custom_derivatives_allowed_effects,
              effects.remat_allowed_effects):
    _kind.add_type(GradsyncEffect)


def _register():
    """Registers the FFI targets; None, or why jit is unavailable."""
    if not os.path.exists(LIBRARY):
        return (f"{LIBRARY} was not built: gradsync finds jax's FFI headers at build time "
                "(jax importable by the Python that builds gradsync, or GRADSYNC_JAX_INCLUDE; "
                "docs/GUIDE.md, JAX)")
    import jax.ffi
    try:
        lib = ctypes.cdll.LoadLibrary(LIBRARY)
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(f"gradsync_{target}",
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as exc:  # noqa: BLE001  (said when a tracer arrives)
        return f"{LIBRARY} could not be loaded: {exc}"
    try:  # CUDA: XLA's stream (a jaxlib without CUDA takes them for later, or refuses)
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(f"gradsync_{target}",
                                        jax.ffi.pycapsule(getattr(lib, symbol + "Cuda")),
                                        platform="CUDA")
    except Exception:  # noqa: BLE001, S110  (no CUDA in this jaxlib: CPU only)
        pass
    return None


UNAVAILABLE = _register()

collective_p = Primitive("gradsync_collective")
collective_p.multiple_results = True


def _out_avals(avals, kind, size, rank):
    if kind == "allgather":
        return [ShapedArray((a.shape[0] * size,) + a.shape[1:], a.dtype) for a in avals]
    if kind == "reduce_scatter":
        return [ShapedArray((a.shape[0] // size + (rank < a.shape[0] % size),) + a.shape[1:],
                            a.dtype) for a in avals]
    return [ShapedArray(a.shape, a.dtype) for a in avals]


@collective_p.def_effectful_abstract_eval
def _abstract(*avals, kind, comm, size, rank, attrs):
    return _out_avals(avals, kind, size, rank), {EFFECT}


collective_p.def_impl(lambda *args, **params: dispatch.apply_primitive(collective_p, *args,
                                                                         **params))


def _layout(aval):
    return list(reversed(range(len(aval.shape))))


def _lowering(ctx, *args, kind, comm, size, rank, attrs):
    token = ctx.tokens_in.get(EFFECT)
    config = {"comm": np.int64(comm)}
    for name, value in attrs:
        config[name] = np.float64(value) if isinstance(value, float) else np.int64(value)
    op = _mlir.custom_call(
        f"gradsync_{kind}",
        result_types=[mlir.token_type()] + [mlir.aval_to_ir_type(ctx.module_context, a)
                                            for a in ctx.avals_out],
        operands=[token, *args],
        backend_config={k: mlir.ir_attribute(v) for k, v in config.items()},
        has_side_effect=True,
        api_version=4,
        # allreduce and broadcast write their results over their inputs: in
        # place where XLA can give the input's buffer (a temporary, or a
        # donated argument), after XLA's copy where it cannot
        operand_output_aliases={i + 1: i + 1 for i in range(len(args))}
        if kind in ("allreduce", "broadcast") else None,
        operand_layouts=[[]] + [_layout(a) for a in ctx.avals_in],
        result_layouts=[[]] + [_layout(a) for a in ctx.avals_out])
    results = list(op.results)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: results[0]})))
    return results[1:]


mlir.register_lowering(collective_p, _lowering, platform="cpu")
mlir.register_lowering(collective_p, _lowering, platform="cuda")


def _batch(args, dims, *, kind, **params):
    """vmap: a batched leading axis. Elementwise collectives take the batch
    axis first; allgather and reduce_scatter work on dim 0 of the unbatched
    arrays, so there the batch axis goes second. An unbatched argument is
    broadcast over the batch."""
    import jax.numpy as jnp
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    at = 1 if kind in ("allgather", "reduce_scatter", "alltoall") else 0
    moved = []
    for x, d in zip(args, dims):
        if d is None:
            x, d = jnp.broadcast_to(x, (size,) + x.shape), 0
        if at == 1 and x.ndim < 2:
            raise ValueError(f"gradsync.jax.{kind} under vmap needs arrays with a dim 0 "
                             "besides the batch axis")
        moved.append(jnp.moveaxis(x, d, at))
    return collective_p.bind(*moved, kind=kind, **params), [at] * len(moved)


batching.primitive_batchers[collective_p] = _batch


def bind(leaves, kind, comm, attrs=()):
    """The primitive on a list of arrays (tracers): a list of results."""
    return collective_p.bind(*leaves, kind=kind, comm=int(comm.c_handle), size=comm.size,
                             rank=comm.rank, attrs=tuple(attrs))
