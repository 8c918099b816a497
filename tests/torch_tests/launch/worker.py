"""One rank of a launch test (tests/torch_tests/test_launch.py): started by
torchrun, torch's spawn harness or the test itself, never by mpiexec.

``python worker.py OUT_DIR [init_method | communicator-first]``: joins the
"gradsync" process group (env:// unless an init_method is given, with RANK
and WORLD_SIZE from the environment; with ``communicator-first`` a plain
gs.Communicator() is made before init_process_group, so gradsync joins from
the environment and torch's group reuses that world), allreduces a float64
tensor through torch.distributed and a NumPy array through a plain
gs.Communicator(), and writes what it saw to
OUT_DIR/rank<R>.json for the test to check against NumPy.
"""
import json
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

import gradsync as gs
import gradsync.torch.distributed  # noqa: F401  (registers "gradsync")


def contribution(rank, n=5):
    """What rank ``rank`` adds: distinct per rank, exact in float64."""
    return np.arange(n, dtype=np.float64) * (rank + 1) + 0.25 * rank


def _local_size():
    """Ranks of gradsync's world that MPI places on this node."""
    local = gs.world().Split_type(gs.MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size()
    finally:
        local.Free()


def main(out_dir, init_method=None):
    kwargs = {}
    first = gs.Communicator() if init_method == "communicator-first" else None
    if init_method and not first:
        kwargs = {"init_method": init_method, "rank": int(os.environ["RANK"]),
                  "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group("gradsync", **kwargs)
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.from_numpy(contribution(rank))
    dist.all_reduce(t)
    comm = first or gs.Communicator()
    x = contribution(rank)
    comm.allreduce_(x)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([rank], dtype=torch.int64))
    record = {"rank": rank, "size": size, "env_rank": os.environ.get("RANK"),
              "host": socket.gethostname(), "local_size": _local_size(),
              "gs_rank": comm.rank, "gs_size": comm.size,
              "mpi_world": [gs.MPI.COMM_WORLD.Get_rank(), gs.MPI.COMM_WORLD.Get_size()],
              "torch_sum": t.tolist(), "gs_sum": x.tolist(),
              "gathered": [int(g.item()) for g in gathered]}
    comm.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
