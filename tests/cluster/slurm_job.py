"""A job for tests/cluster/test_slurm.py, started by srun: each task writes
OUT/<rank>.json with the world it got (gradsync's rank and size, Slurm's
task id) and the result of one allreduce, or the error it raised.

  allreduce   gs.Communicator(): every task adds rank + 1
  torch       torch.distributed.init_process_group("gradsync") and one
              all_reduce through it
"""
import json
import os
import sys

import numpy as np


def main():
    mode, out = sys.argv[1], sys.argv[2]
    task = int(os.environ["SLURM_PROCID"])
    rec = {"task": task}
    try:
        import gradsync as gs
        if mode == "torch":
            import torch
            import torch.distributed as dist

            import gradsync.torch.distributed  # noqa: F401  (registers the backend)
            dist.init_process_group("gradsync")
            t = torch.full((5,), dist.get_rank() + 1.0)
            dist.all_reduce(t)
            rec.update(rank=dist.get_rank(), size=dist.get_world_size(), got=t.tolist())
            dist.destroy_process_group()
        else:
            comm = gs.Communicator()
            x = np.full(5, comm.rank + 1.0, np.float64)
            comm.allreduce_(x)
            rec.update(rank=comm.rank, size=comm.size, got=x.tolist())
    except Exception as e:  # noqa: BLE001 - the test judges it
        rec.update(error=type(e).__name__, message=str(e))
    with open(os.path.join(out, "%d.json" % task), "w") as f:
        json.dump(rec, f)
    sys.exit(1 if "error" in rec else 0)


if __name__ == "__main__":
    main()
