"""A jitted JAX training step with gradsync's allreduce inside jax.jit,
against the same step split around gradsync outside jit (issue 49).

    mpiexec -n 2 python -m bench.jax_jit [--repeats 7] [--latency-iters 300]

The step is ``grads = f(params)`` (an elementwise stand-in for jax.grad),
``grads = allreduce(grads, op="average")`` (one fused call), ``params -
0.1 * grads``. "inside": one jitted function; "split": jit(f), gsj.allreduce
outside jit, jit(update). Three cases: 16 float32 (latency), ResNet-50's
gradient list (161 float32 tensors, 25.6 M elements, gsbench's shapes); and
the 16 floats' step ten times, under lax.scan in one jitted call against ten
split steps (times per ten steps). Each
call is timed to its results being ready, the slowest rank's time; the
ways alternate per repeat. Prints medians and inside/split. Where mpi4jax
is importable (not installed by the project: ``pip install mpi4jax``), a
third way: the same step inside jit with mpi4jax's allreduce, one call per
array (mpi4jax has no fused list), then divided by the rank count; printed
as mpi4jax/inside. A benchmark, not a test.
"""
import argparse
import time

import numpy as np

import gradsync as gs
from gradsync.bench.data import load_shapes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--latency-iters", type=int, default=300)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import gradsync.jax as gsj
    comm = gs.Communicator()
    world = gs.world()

    def grad_of(params):
        return jax.tree_util.tree_map(lambda a: a * 1e-3 + 1.0, params)

    def update(params, grads):
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, grads)

    inside = jax.jit(lambda prm: update(prm, gsj.allreduce(grad_of(prm), comm, op="average")))
    jit_grad, jit_update = jax.jit(grad_of), jax.jit(update)

    def split(prm):
        return jit_update(prm, gsj.allreduce(jit_grad(prm), comm, op="average"))

    def one_step(prm, _):
        return update(prm, gsj.allreduce(grad_of(prm), comm, op="average")), None

    scanned = jax.jit(lambda prm: jax.lax.scan(one_step, prm, None, length=10)[0])
    try:
        import mpi4jax
    except ImportError:
        mpi4jax = None

    def m4j_average(grads):
        return jax.tree_util.tree_map(
            lambda g: mpi4jax.allreduce(g, op=gs.MPI.SUM, comm=world) / world.size, grads)

    def m4j_step(prm, _):
        return update(prm, m4j_average(grad_of(prm))), None

    with_m4j = {} if mpi4jax is None else {
        "mpi4jax": jax.jit(lambda prm: update(prm, m4j_average(grad_of(prm)))),
        "mpi4jax scan": jax.jit(lambda prm: jax.lax.scan(m4j_step, prm, None, length=10)[0])}

    def split_ten(prm):
        for _ in range(10):
            prm = split(prm)
        return prm

    def timed(fn, prm, iters):
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            prm = fn(prm)
        jax.block_until_ready(prm)
        return world.allreduce((time.perf_counter() - t0) / iters, op=gs.MPI.MAX), prm

    shapes, _ = load_shapes("resnet50")
    cases = [("16 float32", [jnp.zeros((16,), jnp.float32)], args.latency_iters),
             ("resnet50 list", [jnp.zeros(s, jnp.float32) for s in shapes], 1)]
    cases.insert(1, ("16 float32, 10 steps under lax.scan", cases[0][1], args.latency_iters // 10))
    for label, params, iters in cases:
        ways = {"inside": scanned, "split": split_ten} if "scan" in label else \
            {"inside": inside, "split": split}
        if with_m4j:
            ways["mpi4jax"] = with_m4j["mpi4jax scan" if "scan" in label else "mpi4jax"]
        times = {name: [] for name in ways}
        results = {}
        for name, fn in ways.items():  # compile and warm up
            results[name] = timed(fn, params, max(1, iters // 10))[1]
        same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
                   zip(jax.tree_util.tree_leaves(results["inside"]),
                       jax.tree_util.tree_leaves(results["split"])))
        for _ in range(args.repeats):
            for name, fn in ways.items():
                times[name].append(timed(fn, params, iters)[0])
        if comm.rank == 0:
            med = {k: float(np.median(v)) for k, v in times.items()}
            print(f"{comm.size} ranks, {label}: inside jit {1e6 * med['inside']:.1f} us, "
                  f"split around gradsync {1e6 * med['split']:.1f} us, inside/split "
                  f"{med['inside'] / med['split']:.2f} (median of {args.repeats}; "
                  f"results bitwise equal: {same})"
                  + (f"; mpi4jax inside jit {1e6 * med['mpi4jax']:.1f} us, mpi4jax/inside "
                     f"{med['mpi4jax'] / med['inside']:.2f}" if "mpi4jax" in med else ""),
                  flush=True)
    comm.close()


if __name__ == "__main__":
    main()
