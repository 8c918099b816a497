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
broadcast, allgather and alltoall (docs/GUIDE.md, JAX). ``comm`` defaults to one
gs.Communicator over COMM_WORLD shared with gradsync.torch. Every
collective is collective: every rank calls it, with the same pytree
structure, in the same order.

``import gradsync`` never imports jax; this module does, and fails at
import on a JAX outside SUPPORTED_JAX.
"""
import jax

from gradsync.jax._version import SUPPORTED_JAX, version_problem

if version_problem(jax.__version__):
    raise ImportError(version_problem(jax.__version__))

from gradsync.jax.collectives import (  # noqa: E402
    adasum,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    checked,
    gradsync_error,
    jit_available,
    reduce_scatter,
)
from gradsync.jax.kernels import accumulate, all_finite, scale  # noqa: E402

__all__ = ["SUPPORTED_JAX", "adasum", "accumulate", "all_finite", "allgather", "allreduce",
           "alltoall", "broadcast", "checked", "gradsync_error", "jit_available", "reduce_scatter",
           "scale"]
