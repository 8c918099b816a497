"""Time from a rank's SIGKILL to the survivors' first completed step.

    python -m bench.elastic [--trials 10] [--ranks 4] [--elements 1000]

Each trial starts ``--ranks`` processes joined by gs.init through a folder
store (as tests/python/test_shrink.py does) that train with
gradsync.elastic, one allreduce of ``--elements`` float32 a step, a commit
after each. The last rank SIGKILLs itself at step 3, between steps; the
survivors catch gs.PeerLostError, shrink, restore, sync and train on. Per
trial: seconds from the kill (the killed rank's clock, CLOCK_MONOTONIC: one
host) to the slowest survivor's first step completed in the new world, and
the steps the survivors ran twice (lost work), and how much rank 0's
resident memory grew from the step before the loss to its end (what the
abandoned communicator keeps). Prints each trial and the median. A
benchmark, not a test.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

JOB = r"""
import os, signal, sys, time
import numpy as np
import gradsync as gs
from joined import DirStore

rank, size, store, n = int(sys.argv[1]), int(sys.argv[2]), DirStore(sys.argv[3]), int(sys.argv[4])
STEPS, KILL = 6, 3
gs.init(store, rank=rank, world_size=size)
runs, before = 0, 0

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def train(state, comm):
    global runs, before
    while state.step < STEPS:
        if state.step == KILL - 1 and comm.size == size:
            before = rss()
        if rank == size - 1 and state.step == KILL:
            print("KILL %.6f" % time.monotonic(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = np.ones(n, np.float32)
        comm.allreduce_(g)
        runs += 1
        if comm.size < size and not state.first:
            print("FIRST %.6f" % time.monotonic(), flush=True)
            state.first = True
        state.w -= g
        state.step += 1
        state.commit()

state = gs.elastic.State(w=np.zeros(n, np.float32), step=0, first=False)
gs.elastic.run(train, state, gs.Communicator(stall_seconds=0))
print("RERUN %d" % (runs - STEPS), flush=True)
if rank == 0:
    print("RSS %d" % (rss() - before), flush=True)
os._exit(0)
"""


def trial(ranks, elements):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(here, "..", "pyx"),
                                         os.path.join(here, "..", "tests", "python"),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("GRADSYNC_TIMEOUT_SECONDS", "60")
    with tempfile.TemporaryDirectory() as store:
        procs = [subprocess.Popen([sys.executable, "-c", JOB, str(r), str(ranks), store,
                                   str(elements)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
        outs = [p.communicate(timeout=120)[0] for p in procs]

    def values(tag, out):
        return [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith(tag + " ")]

    killed = values("KILL", outs[-1])
    firsts = [v for out in outs[:-1] for v in values("FIRST", out)]
    reruns = [v for out in outs[:-1] for v in values("RERUN", out)]
    grown = values("RSS", outs[0])
    if not killed or len(firsts) != ranks - 1:
        raise RuntimeError("a trial did not finish:\n" + "\n---\n".join(o[-2000:] for o in outs))
    return max(firsts) - killed[0], max(reruns), grown[0] if grown else float("nan")


def soak(trials, seed):
    """--soak: random kill points through test_shrink.py's job."""
    import random

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "python"))
    import test_shrink
    from joined import replay

    from gsutil import run_joined

    rng = random.Random(seed)
    points = {"between": 1001, "inside-small": 1001, "inside-large": 600001,
              "inside-wire": 300001, "second": 33}
    passed = 0
    for t in range(trials):
        mode = rng.choice(sorted(points))
        step, n = rng.randint(1, test_shrink.STEPS - 2), points[mode]
        with tempfile.TemporaryDirectory() as store:
            procs, outs = run_joined(test_shrink.JOB, 4, {"GRADSYNC_TIMEOUT_SECONDS": "60"},
                                     args=(store, mode, step, n, 4, -1), timeout=120)
        left = [0, 1] if mode == "second" else [0, 1, 3]
        results = []
        for r in left:
            line = [ln for ln in outs[r].splitlines() if ln.startswith("RESULT ")]
            results.append(json.loads(line[-1][7:]) if procs[r].returncode == 0 and line else None)
        ok = all(results) and all((x["w"], x["history"]) == (results[0]["w"],
                                                              results[0]["history"])
                                  for x in results)
        history = results[0]["history"] if ok else []
        ok = ok and history in ([[0, 1, 2, 3]] * k + [left] * (test_shrink.STEPS - k)
                                for k in (step, step + 1))
        ok = ok and bytes.fromhex(results[0]["w"]) == replay(history, n).tobytes()
        passed += ok
        print(f"trial {t}: rank 2 lost at step {step}, {mode}: {'ok' if ok else 'FAILED'}",
              flush=True)
        if not ok:
            print("\n---\n".join(o[-1500:] for o in outs), flush=True)
    print(f"{passed} of {trials} trials: the survivors trained every step, bit for bit")
    return 0 if passed == trials else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--elements", type=int, default=1000)
    ap.add_argument("--soak", type=int, default=0, help="random kill points, N trials")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.soak:
        return soak(args.soak, args.seed)
    times = []
    for t in range(args.trials):
        seconds, rerun, grown = trial(args.ranks, args.elements)
        times.append(seconds)
        print(f"trial {t}: {seconds:.3f} s from the kill to the survivors' first step; "
              f"steps run twice: {int(rerun)}; rank 0's memory grew {grown / 2**20:.1f} MiB "
              "from the step before the loss to the end", flush=True)
    print(f"median of {len(times)}: {statistics.median(times):.3f} s ({args.ranks} ranks, "
          f"{args.elements} float32 a step)")


if __name__ == "__main__":
    sys.exit(main())
