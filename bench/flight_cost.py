"""What the flight recorder costs a call: the same job with the recorder off
(GRADSYNC_FLIGHT_ENTRIES=0), on (the default ring) and on with Python stacks
(GRADSYNC_FLIGHT_STACKS=1), each a fresh job (the ring's size is fixed when
a process starts), the three alternated per repeat so load falls on all alike.

    python -m bench.flight_cost [--ranks 1,2] [--repeats 7]

Each job times, on every rank, 16-float ``comm.allreduce_`` calls (blocks of
CALLS, the best block's mean per call; the slowest rank's) and, at more than
one rank, ResNet-50's gradient list (161 float32 arrays, ``allreduce_`` in
place, the median of LIST_CALLS calls; the slowest rank's per call). The
driver prints medians over repeats, the per-call difference on - off and
the ratio on / off. A benchmark, not a test.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"off": {"GRADSYNC_FLIGHT_ENTRIES": "0"},
            "on": {},
            "stacks": {"GRADSYNC_FLIGHT_STACKS": "1"}}
CALLS, BLOCKS, LIST_CALLS = 20000, 7, 9


def worker(out):
    import numpy as np

    import gradsync as gs
    from gradsync.bench.data import load_shapes

    world = gs.MPI.COMM_WORLD
    comm = gs.Communicator()
    x = np.ones(16, np.float32)
    for _ in range(2000):
        comm.allreduce_(x)
    blocks = []
    for _ in range(BLOCKS):
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            comm.allreduce_(x)
        blocks.append((time.perf_counter() - t0) / CALLS)
    rec = {"tiny_us": world.allreduce(min(blocks), op=gs.MPI.MAX) * 1e6,
           "recorded": gs.build_info().get("flight_entries")}
    if world.size > 1:
        shapes, _ = load_shapes("resnet50")
        grads = [np.ones(int(np.prod(s)), np.float32) for s in shapes]
        times = []
        for i in range(LIST_CALLS + 2):
            world.Barrier()
            t0 = time.perf_counter()
            comm.allreduce_(grads, "average")
            t = world.allreduce(time.perf_counter() - t0, op=gs.MPI.MAX)
            if i >= 2:
                times.append(t)
        rec["list_ms"] = statistics.median(times) * 1e3
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(rec, f)


def run_job(ranks, variant, folder):
    out = os.path.join(folder, "%s-%d.json" % (variant, ranks))
    env = dict(os.environ)
    env.pop("GRADSYNC_FLIGHT_ENTRIES", None)
    env.pop("GRADSYNC_FLIGHT_STACKS", None)
    env.update(VARIANTS[variant])
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "bench.flight_cost",
           "--worker", out]
    subprocess.run(cmd, check=True, env=env, timeout=600)
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    for ranks in [int(r) for r in args.ranks.split(",")]:
        got = {v: [] for v in VARIANTS}
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(args.repeats):
                for v in VARIANTS:
                    got[v].append(run_job(ranks, v, folder))
        med = {v: {k: statistics.median(r[k] for r in runs) for k in runs[0]
                   if isinstance(runs[0][k], float)} for v, runs in got.items()}
        print("%d rank(s), median of %d jobs per variant" % (ranks, args.repeats))
        for key, unit in (("tiny_us", "us per 16-float call"),
                          ("list_ms", "ms per ResNet-50 list")):
            if key not in med["off"]:
                continue
            off = med["off"][key]
            for v in ("on", "stacks"):
                print("  %-22s off %8.3f  %-6s %8.3f  diff %+8.3f  ratio %.3f  (runs: %s)" % (
                    unit, off, v, med[v][key], med[v][key] - off, med[v][key] / off,
                    " ".join("%.3f" % r[key] for r in got[v])))
            print("  %-22s off runs: %s" % ("", " ".join("%.3f" % r[key] for r in got["off"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
