"""gradsync: collective communication for distributed deep-learning training.

A C runtime (fused MPI collectives, validation, kernels) under a thin Python
layer that takes NumPy arrays and anything that speaks DLPack::

    import gradsync as gs
    comm = gs.Communicator()
    comm.allreduce_(grads, op="average")     # one fused message for the list
"""
from gradsync._mpi import check_same_mpi as _check_same_mpi, import_mpi as _import_mpi

MPI = _import_mpi()

from gradsync import _core  # noqa: E402

_check_same_mpi(MPI, _core)

from gradsync._core import (  # noqa: E402
    ArgumentError,
    ClosedError,
    DtypeError,
    Error,
    MismatchError,
    UnsupportedError,
    bfloat16,
)
from gradsync.communicator import Communicator  # noqa: E402
from gradsync.kernels import accumulate_, accumulate_v2_, all_finite, scale_, zero_  # noqa: E402
from gradsync.ops import Op  # noqa: E402
from gradsync.partition import AllSumReduce, Partition, zero_volume_array  # noqa: E402
from gradsync.shard import ShardLayout  # noqa: E402

__version__ = _core.version()

_THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def build_info():
    """What this gradsync was built with and runs on: MPI library and version,
    thread level, CUDA and NCCL versions (None when absent), SIMD level and
    the default fusion threshold."""
    c = _core.build_info_c()
    return {
        "version": c["version"],
        "mpi_library": c["mpi_library_version"].splitlines()[0] if c["mpi_library_version"] else "",
        "mpi_library_version": c["mpi_library_version"],
        "mpi_library_path": c["mpi_library_path"],
        "mpi_version": "%d.%d" % MPI.Get_version(),
        "mpi_thread_level": _THREAD_LEVELS.get(c["mpi_thread_level"], "unknown"),
        "cuda": c["cuda_version"] or None,
        "nccl": c["nccl_version"] or None,
        "simd": c["simd"],
        "fusion_threshold": c["default_fusion_threshold"],
        "check_payload_bytes": c["check_payload_bytes"],
    }


__all__ = [
    "AllSumReduce", "ArgumentError", "ClosedError", "Communicator", "DtypeError", "Error",
    "MismatchError", "Op", "Partition", "ShardLayout", "UnsupportedError", "accumulate_",
    "accumulate_v2_", "all_finite", "bfloat16", "build_info", "scale_", "zero_",
    "zero_volume_array",
]
