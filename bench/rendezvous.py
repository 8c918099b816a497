"""torch.distributed for the benchmarks that compare against its backends."""

import os
import socket


def init_process_group(world, backend):
    """``torch.distributed.init_process_group(backend)`` with env:// values
    for every rank of the mpi4py communicator ``world``: rank 0 picks a free
    local port for the TCP store and tells the others, so a gloo group can
    join even when the default group runs on gradsync."""
    import torch.distributed as dist

    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(world.rank), WORLD_SIZE=str(world.size))
    dist.init_process_group(backend)
