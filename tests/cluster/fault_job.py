"""An MPI job for tests/cluster/test_cluster_faults.py, run inside
scripts/simcluster: a stream of mixed collectives, every result checked,
while one host fails part-way through.

  --mode linkdown   the first rank of the last host takes its host's data
                    link down (ip link set data0 down) --after seconds
                    after its first checked batch of calls;
                    with GRADSYNC_TIMEOUT_SECONDS set, every rank should raise
  --mode kill       the same rank SIGKILLs every rank of its host (itself
                    last); the launcher should end the job

Each rank writes OUT/rank<r>.json when its stream ends with an error: the
exception's type and message and when it was raised. Every call that
returned is checked against the value it must hold (a half-reduced value
reported as success is recorded as "bad"); OUT/events.jsonl gets one line
per rank per checked call batch, so a killed rank's last state is known.
"""
import argparse
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
from mpi4py import MPI

import gradsync as gs

WORLD = MPI.COMM_WORLD


def note(out, **kw):
    kw.update(rank=WORLD.rank, t=time.time())
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


def fail_host(mode, after, out, host_pids, streaming):
    # `after` counts from the first checked batch, not from the start: on a
    # slow machine the start-up alone could outlast a fixed delay, and the
    # fault would then hit before any hierarchical message was counted.
    streaming.wait(120)
    time.sleep(after)
    with open(os.path.join(out, "fault_at"), "w") as f:
        f.write("%r\n" % time.time())
    if mode == "linkdown":
        iface = os.environ["SIMCLUSTER_DATA_IFACE"]
        subprocess.run(["ip", "link", "set", iface, "down"], check=True)
        return
    for pid in sorted(host_pids, key=lambda p: p == os.getpid()):
        os.kill(pid, signal.SIGKILL)


def stream(comm, out, seconds, bad, streaming):
    """Mixed collectives, each result checked (what is wrong goes to `bad`);
    sets `streaming` once the first batch is noted; returns the calls made
    when time is up."""
    p, r = comm.size, comm.rank
    big = np.empty(10 << 18, np.float32)       # 10 MiB: hierarchical by default
    mid = np.empty(3000, np.float32)           # 12 KB: flat
    tiny = np.empty(4, np.float64)             # rides in the validation message
    grads = [np.empty(n, np.float32) for n in (70000, 5, 30000, 1)]
    end = time.time() + seconds
    i = 0
    while time.time() < end:
        i += 1
        for a in (big, mid, tiny):
            a.fill(r + i)
        comm.allreduce_([big, mid, tiny])
        want = p * (p - 1) / 2 + p * i
        for name, a in (("big", big), ("mid", mid), ("tiny", tiny)):
            if not np.all(a == want):
                bad.append("call %d %s: %r != %r" % (i, name, a[:2].tolist(), want))
        for g in grads:
            g.fill(1.0)
        comm.allreduce_(grads, "average")
        if not all(np.all(g == 1.0) for g in grads):
            bad.append("call %d average" % i)
        b = np.full(50000, r, np.int32)
        comm.broadcast_(b, root=i % p)
        if not np.all(b == i % p):
            bad.append("call %d broadcast" % i)
        g = comm.allgather(np.full((2, 3), r, np.int64))
        if not np.array_equal(g[:, 0], np.repeat(np.arange(p), 2)):
            bad.append("call %d allgather" % i)
        if i == 1 or i % 10 == 0:
            note(out, calls=i, bad=bad, hierarchical=comm.stats()["hierarchical"])
            streaming.set()
    return i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("linkdown", "kill"), required=True)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    comm = gs.Communicator()
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    host_pids = node.allgather(os.getpid())
    last_host_first = WORLD.size - node.size if node.rank == 0 else -1
    is_injector = WORLD.allreduce(last_host_first, op=MPI.MAX) == WORLD.rank
    node.Free()
    streaming = threading.Event()
    if is_injector:
        threading.Thread(target=fail_host,
                         args=(args.mode, args.after, args.out, host_pids, streaming),
                         daemon=True).start()
    t_start = time.time()
    bad = []
    try:
        record = {"error": None, "calls": stream(comm, args.out, args.seconds, bad, streaming)}
    except Exception as e:  # noqa: BLE001 - gs.Error or MPI's: the driver judges
        record = {"error": type(e).__name__, "gradsync": isinstance(e, gs.Error),
                  "message": str(e), "raised_at": time.time()}
    record.update(rank=WORLD.rank, started=t_start, bad=bad)
    with open(os.path.join(args.out, "rank%d.json" % WORLD.rank), "w") as f:
        json.dump(record, f)
    # A rank that exits with an error makes the launcher kill the others:
    # give every rank time to write its own record first (up to 30 s).
    until = time.time() + 30
    while record["error"] and time.time() < until and not all(
            os.path.exists(os.path.join(args.out, "rank%d.json" % r)) for r in range(WORLD.size)):
        time.sleep(0.1)
    # The communicator is unusable and a peer may be unreachable: MPI_Finalize
    # could wait on it, so leave without it (what a job script would do by
    # letting the exception end it under `python -m mpi4py`).
    os._exit(3 if record["error"] else 0)


if __name__ == "__main__":
    main()
