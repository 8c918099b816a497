"""The allreduce inside one host against MPI and the memory bandwidth, same run.

    mpiexec -n 2 python -m bench.intrahost [--repeats 7] [--cases resnet50,64Mi,200x768,16]
                                           [--skip mpi4py] [--latency 4,256,4096,65536,1048576]

For each case (ResNet-50's 161 float32 gradients, each its own array, or
``resnet50-views``: the same list as views of one array; one 64 MiB
tensor; 200 tensors of 768 floats; 16 floats) it times, interleaved per repeat so that
load falls on all alike, the slowest rank's time of:

  direct   gradsync's ``allreduce_`` of the list in place (inside one host
           the ranks read each other's memory: transport/mpi/cma.c; the list's
           2 MiB blocks gathered into huge pages at its second call:
           transport/mpi/cma_pages.c, done in the warm-up)
  small    the same on a copy of the list, with GRADSYNC_CMA_HUGEPAGES=0
           (the pages left as the allocator made them)
  mpi      the same call on a communicator made with GRADSYNC_CMA_BYTES=0
           (gradsync's MPI path, as before issue 33)
  mpi4py   one pre-fused MPI ``Allreduce`` of the same bytes (MPI_IN_PLACE)

and a NumPy copy of the message on every rank at once, from which it
derives the memory bandwidth each rank gets (bytes read + written per
second) and the bound for the direct path: the bytes it touches per rank,
2 times the message (the peers' share of its slice read for the reduction,
its own read and written, the reduced slice written into the peers), over
that bandwidth. Prints medians, ratios to mpi4py and the bound's share of the
time (1.0: at the bandwidth limit).

``--latency SIZES`` (bytes) times instead one float32 array allreduced in
place, per call (the median over repeats of the mean of a loop of calls),
by gradsync (validation on: inside one host the call rides the shared
region, transport/shm/), gradsync with GRADSYNC_SHM_BYTES=0 (the MPI path),
and mpi4py's Allreduce; ``--cases`` may be empty then. A benchmark, not a
test.
"""
import argparse
import os
import time

import numpy as np

import gradsync as gs
from gradsync.bench.data import load_shapes


def case_counts(name):
    if name in ("resnet50", "resnet50-views"):
        shapes, _ = load_shapes("resnet50")
        return [int(np.prod(s)) for s in shapes]
    if "x" in name:
        k, n = name.split("x")
        return [int(n)] * int(k)
    units = {"Mi": 1 << 20, "Ki": 1 << 10}
    for suffix, mult in units.items():
        if name.endswith(suffix):
            return [int(name[: -len(suffix)]) * mult // 4]  # bytes -> float32 elements
    return [int(name)]


def timed(world, fn):
    world.Barrier()
    t0 = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - t0, op=gs.MPI.MAX)


def run_case(name, counts, direct, small_pages, through_mpi, world, repeats, skip=()):
    rng = np.random.default_rng(world.rank)
    base = [rng.standard_normal(n).astype(np.float32) for n in counts]
    flat = np.concatenate(base) if base else np.zeros(0, np.float32)
    if name.endswith("-views"):  # the list as views of one allocation
        grads = np.split(flat.copy(), np.cumsum(counts)[:-1])
    else:  # one allocation per tensor, as frameworks make them
        grads = [b.copy() for b in base]
    other = [g.copy() for g in grads]  # small_pages' own memory, never gathered
    fused = flat.copy()
    src, dst = flat.copy(), np.empty_like(flat)
    variants = {
        "direct": lambda: direct.allreduce_(grads),
        "small": lambda: small_pages.allreduce_(other),
        "mpi": lambda: through_mpi.allreduce_(grads),
        "mpi4py": lambda: world.Allreduce(gs.MPI.IN_PLACE, fused, op=gs.MPI.SUM),
        "copy": lambda: np.copyto(dst, src),
    }
    variants = {v: fn for v, fn in variants.items() if v not in skip}
    times = {v: [] for v in variants}
    for fn in variants.values():  # warm-up: buffers, pages, the probe; the gathering
        fn()
        fn()
    for _ in range(repeats):
        for v, fn in variants.items():
            for g, o, b in zip(grads, other, base):
                g[...] = b
                o[...] = b
            fused[...] = flat
            times[v].append(timed(world, fn))
    med = {v: float(np.median(times[v])) if v in times else float("nan")
           for v in ("direct", "small", "mpi", "mpi4py", "copy")}
    nbytes = 4 * sum(counts)
    p = world.size
    bandwidth = 2 * nbytes / med["copy"] if med["copy"] > 0 else float("nan")
    touched = 2 * nbytes if p > 1 else 0
    bound = touched / bandwidth
    return med, nbytes, touched, bound


def latency(sizes, world, repeats):
    """Per-call microseconds at each size: gradsync, gradsync through MPI,
    mpi4py; the three interleaved per repeat so load falls on all alike."""
    region = gs.Communicator()
    os.environ["GRADSYNC_SHM_BYTES"] = "0"  # read when a communicator is made
    through_mpi = gs.Communicator()
    del os.environ["GRADSYNC_SHM_BYTES"]
    if world.rank == 0:
        print(f"{world.size} ranks on one host, one float32 array in place, us per call "
              f"(median of {repeats}); gradsync rides a {region.ride_bytes}-byte slot")
        print(f"{'bytes':>9s} {'gradsync':>9s} {'gs via MPI':>11s} {'mpi4py':>8s} "
              f"{'gs/mpi4py':>10s} {'gs MPI/mpi4py':>14s}")
    for nbytes in sizes:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        loops = max(20, min(2000, (8 << 20) // max(nbytes, 1)))
        variants = {"gradsync": lambda: region.allreduce_(x),
                    "mpi": lambda: through_mpi.allreduce_(x),
                    "mpi4py": lambda: world.Allreduce(gs.MPI.IN_PLACE, x, op=gs.MPI.SUM)}
        times = {v: [] for v in variants}
        for _ in range(repeats + 1):  # the first round warms up
            for v, fn in variants.items():
                def loop(fn=fn):
                    for _ in range(loops):
                        fn()
                times[v].append(timed(world, loop) / loops)
        med = {v: float(np.median(t[1:])) * 1e6 for v, t in times.items()}
        if world.rank == 0:
            print(f"{nbytes:9d} {med['gradsync']:9.2f} {med['mpi']:11.2f} {med['mpi4py']:8.2f} "
                  f"{med['gradsync'] / med['mpi4py']:10.2f} {med['mpi'] / med['mpi4py']:14.2f}",
                  flush=True)
    through_mpi.close()
    region.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", default="resnet50,64Mi,200x768,16")
    ap.add_argument("--skip", default="", help="variants not run, e.g. mpi4py (oversubscribed "
                    "ranks make MPICH's busy polling take seconds per call)")
    ap.add_argument("--latency", default="", help="bytes, comma-separated: per-call times of "
                    "one small array instead (with --cases '' alone)")
    args = ap.parse_args(argv)
    if args.latency:
        latency([int(b) for b in args.latency.split(",")], gs.world(), args.repeats)
    if not args.cases:
        return
    direct = gs.Communicator()
    os.environ["GRADSYNC_CMA_HUGEPAGES"] = "0"  # read when a communicator is made
    small_pages = gs.Communicator()
    del os.environ["GRADSYNC_CMA_HUGEPAGES"]
    os.environ["GRADSYNC_CMA_BYTES"] = "0"
    through_mpi = gs.Communicator()
    del os.environ["GRADSYNC_CMA_BYTES"]
    world = gs.world()
    if world.rank == 0:
        print(f"{world.size} ranks on one host, medians of {args.repeats} (slowest rank per call)")
        print(f"{'case':10s} {'MiB':>7s} {'direct ms':>10s} {'small ms':>9s} {'mpi ms':>8s} "
              f"{'mpi4py ms':>10s} "
              f"{'direct/mpi4py':>14s} {'mpi/mpi4py':>11s} {'touched/msg':>12s} "
              f"{'GB/s copy':>10s} {'bound/direct':>13s} {'2M-page MiB':>12s}")
    for name in args.cases.split(","):
        huge = direct.stats()["hugepage_bytes"]
        med, nbytes, touched, bound = run_case(name, case_counts(name), direct, small_pages,
                                               through_mpi, world, args.repeats,
                                               [v for v in args.skip.split(",") if v])
        huge = direct.stats()["hugepage_bytes"] - huge  # rank 0's, gathered in this case
        if world.rank == 0:
            bw = 2 * nbytes / med["copy"] / 1e9 if med["copy"] else float("nan")
            print(f"{name:10s} {nbytes / 2**20:7.2f} {1e3 * med['direct']:10.3f} "
                  f"{1e3 * med['small']:9.3f} {1e3 * med['mpi']:8.3f} {1e3 * med['mpi4py']:10.3f} "
                  f"{med['direct'] / med['mpi4py']:14.2f} {med['mpi'] / med['mpi4py']:11.2f} "
                  f"{touched / max(nbytes, 1):12.2f} {bw:10.1f} {bound / med['direct']:13.2f} "
                  f"{huge / 2**20:12.0f}",
                  flush=True)
    through_mpi.close()
    small_pages.close()
    direct.close()


if __name__ == "__main__":
    main()
