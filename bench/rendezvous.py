"""torch.distributed for the benchmarks that compare against its backends."""

import datetime
import os


def init_process_group(world, backend):
    """``torch.distributed.init_process_group(backend)`` for every rank of
    the mpi4py communicator ``world``, on a TCP store rank 0 opens on a port
    the system picks (port 0: no window between choosing a free port and
    binding it, where another process could take it) and tells the others,
    so a gloo group can join even when the default group runs on gradsync.
    The env:// variables are set to the same values for code that reads
    them."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = port = None
    if world.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world.size, True, timeout=timeout,
                              wait_for_workers=False)  # they learn the port below
        port = store.port
    port = world.bcast(port, root=0)
    if world.rank != 0:
        store = dist.TCPStore("127.0.0.1", port, world.size, False, timeout=timeout)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(world.rank), WORLD_SIZE=str(world.size))
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size)
