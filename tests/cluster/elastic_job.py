"""One host's part of tests/cluster/test_cluster_elastic.py, run once on
every simulated host (scripts/simcluster --per-host): starts this host's
two ranks as MPI singletons (RANK 2 * host + i of WORLD_SIZE 4, a torch
TCPStore at host 0's data address) that train under gradsync.elastic.run.
The first rank of host 1 takes its host's data link down at step LINK_STEP:
host 0's ranks time out, agree without host 1 (whose ranks can no longer
reach the store) and train on as two; host 1's ranks end with an error.
Each rank writes OUT/rank<r>.json: its final weights and the members of
every committed step, or the error it ended with.

    python elastic_job.py OUT PORT            (the host's launcher)
    python elastic_job.py OUT PORT --rank R   (one rank)
"""
import json
import os
import subprocess
import sys
import time

STEPS, LINK_STEP, N = 8, 3, 40000  # 160 KB a step: inside a host and across


def rank_main(out, rank):
    import faulthandler

    import numpy as np
    from joined import train_step

    import gradsync as gs

    def train(state, comm):
        members = [int(r) for r in comm.allgather(np.array([rank], np.int64))]
        while state.step < STEPS:
            if rank == 2 and state.step == LINK_STEP and comm.size == 4:
                subprocess.run(["ip", "link", "set", os.environ["SIMCLUSTER_DATA_IFACE"], "down"],
                               check=True)
            train_step(state, comm, rank, members)
        return state.w

    # a rank still running long after the fault says where it is
    faulthandler.dump_traceback_later(90, exit=True)
    record = {"rank": rank, "host": os.uname().nodename}
    try:
        state = gs.elastic.State(w=np.zeros(N, np.float32), step=0, history=[])
        w = gs.elastic.run(train, state, gs.Communicator(stall_seconds=0))
        record.update(w=w.tobytes().hex(), history=state.history)
    except Exception as e:  # noqa: BLE001 (host 1's ranks: recorded, the test judges)
        record.update(error=f"{type(e).__name__}: {e}"[:2000])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)  # MPI_Finalize would wait for the ranks cut off


def host_main(out, port):
    host = int(os.environ["SIMCLUSTER_HOST_INDEX"])
    tests_python = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    env = dict(os.environ, WORLD_SIZE="4", MASTER_ADDR=os.environ["SIMCLUSTER_HOST0_ADDR"],
               MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([tests_python, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, out, str(port), "--rank", str(r)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r % 2)))
             for r in (2 * host, 2 * host + 1)]
    deadline = time.monotonic() + 150
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return 0


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main(sys.argv[1], int(sys.argv[sys.argv.index("--rank") + 1]))
    sys.exit(host_main(sys.argv[1], int(sys.argv[2])))
