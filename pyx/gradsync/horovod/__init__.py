"""gradsync.horovod: Horovod's framework-neutral API on gradsync (init,
topology, process sets, reduction ops, timeline, build queries). The PyTorch
API is ``gradsync.horovod.torch``: a Horovod script changes only its import::

    import gradsync.horovod.torch as hvd      # was: import horovod.torch as hvd

Collectives run on gradsync's ordered, validated runtime: every rank submits
them in the same order (names take part in the check, so a different order
raises MismatchError on every rank instead of hanging). docs/GUIDE.md,
"Coming from Horovod", lists every function and what differs.
"""
from gradsync.horovod.basics import (  # noqa: F401
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
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
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from gradsync.horovod.engine import HorovodInternalError, JoinedError, MismatchError  # noqa: F401
from gradsync.horovod.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "JoinedError", "Max", "Min", "MismatchError",
    "Product", "ProcessSet", "Sum", "add_process_set", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "global_process_set", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline",
]
