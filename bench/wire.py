"""Low-precision wire formats against float32 on the same ranks, same run.

    mpiexec -n 2 python -m bench.wire [--elements 4Mi] [--repeats 7]

Times ``comm.allreduce_(x, wire=w)`` of a float32 array for float32 (no wire
format) and each of gs.WIRES, interleaved per repeat so that load on the
machine falls on all of them alike; prints the median per format (the
slowest rank's time of each call), its ratio to float32 and the bytes this
rank sent per call (``comm.stats()["bytes"]``). A benchmark, not a test.
"""
import argparse
import time

import numpy as np

import gradsync as gs


def parse_count(text):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "K": 1000, "M": 1000 ** 2}
    for suffix, k in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * k)
    return int(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=parse_count, default=parse_count("4Mi"))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    comm = gs.Communicator()
    world = gs.world()
    rng = np.random.default_rng(comm.rank)
    base = rng.standard_normal(args.elements).astype(np.float32)
    formats = [None] + list(gs.WIRES)
    times = {w: [] for w in formats}
    sent = {}
    x = base.copy()
    for w in formats:  # warm-up: buffers, tables
        comm.allreduce_(x, wire=w) if w else comm.allreduce_(x)
    for _ in range(args.repeats):
        for w in formats:
            x[:] = base
            before = comm.stats()["bytes"]
            world.Barrier()
            t0 = time.perf_counter()
            comm.allreduce_(x, wire=w) if w else comm.allreduce_(x)
            dt = world.allreduce(time.perf_counter() - t0, op=gs.MPI.MAX)
            times[w].append(dt)
            sent[w] = comm.stats()["bytes"] - before
    if comm.rank == 0:
        ref = float(np.median(times[None]))
        print(f"{comm.size} ranks, {args.elements} float32 elements "
              f"({4 * args.elements / 2**20:.1f} MiB), median of {args.repeats}")
        print(f"{'wire':14s} {'median ms':>10s} {'x float32':>10s} {'bytes sent':>12s}")
        for w in formats:
            med = float(np.median(times[w]))
            print(f"{w or 'float32':14s} {1e3 * med:10.2f} {med / ref:10.2f} {sent[w]:12d}")
    comm.close()


if __name__ == "__main__":
    main()
