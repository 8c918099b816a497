"""gradsync.horovod.torch: Horovod's PyTorch API on gradsync. A Horovod
script changes only its import::

    import gradsync.horovod.torch as hvd      # was: import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())                 # on GPUs
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

and is launched with ``mpiexec -n N python train.py`` (or ``gradsyncrun
-np N python train.py``, which takes horovodrun's arguments). Horovod's
semantics hold: allreduce averages by default, root ranks are global,
integer scaling truncates. Collectives are matched by the order in which
ranks submit them; names, when given, take part in the check (a different
order raises MismatchError on every rank). docs/GUIDE.md, "Coming from
Horovod", lists every function and what differs.
"""
from gradsync.horovod import (  # noqa: F401
    Adasum,
    Average,
    HorovodInternalError,
    JoinedError,
    Max,
    Min,
    MismatchError,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from gradsync.horovod.torch import elastic  # noqa: F401,E402
from gradsync.horovod.torch.compression import Compression  # noqa: F401
from gradsync.horovod.torch.functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from gradsync.horovod.torch.mpi_ops import (  # noqa: F401
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from gradsync.horovod.torch.optimizer import DistributedOptimizer  # noqa: F401
from gradsync.horovod.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
