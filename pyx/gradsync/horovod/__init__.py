"""gradsync.horovod: Horovod's framework-neutral API on gradsync (init,
topology, process sets, reduction ops, timeline, build queries). The PyTorch
API is ``gradsync.horovod.torch``: a Horovod script changes only its import::

    import gradsync.horovod.torch as hvd      # was: import horovod.torch as hvd

Operations are matched across ranks by name, as Horovod matches them
(module gradsync.horovod.engine). To run a script whose import line is
Horovod's unchanged, opt in to the ``horovod`` alias: ``install()`` in the
program, or the folder ``python -m gradsync.horovod.alias`` prints on
PYTHONPATH. docs/GUIDE.md, "Coming from Horovod", lists every function and
what differs.
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
from gradsync.horovod.errors import HorovodInternalError, JoinedError, MismatchError  # noqa: F401
from gradsync.horovod.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def install():
    """Makes ``import horovod`` (and horovod.torch, horovod.run, ...) give
    gradsync's alias package in this process, from now on: opt-in, for
    programs whose import line is Horovod's. A ``horovod`` imported before
    (a real Horovod) is left alone and an ImportError says so. Returns the
    alias folder."""
    import sys

    from gradsync.horovod.alias import folder

    loaded = sys.modules.get("horovod")
    if loaded is not None and not getattr(loaded, "__gradsync__", False):
        raise ImportError(f"horovod is already imported from {getattr(loaded, '__file__', '?')}: "
                          "call gradsync.horovod.install() before importing horovod")
    if folder() not in sys.path:
        sys.path.insert(0, folder())
    return folder()


__all__ = [
    "Adasum", "Average", "HorovodInternalError", "JoinedError", "Max", "Min", "MismatchError",
    "Product", "ProcessSet", "Sum", "add_process_set", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "global_process_set", "init",
    "install", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "remove_process_set",
    "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
