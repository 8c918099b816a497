"""gradsync: collective communication for distributed deep-learning training.

A C runtime (fused MPI collectives, validation, kernels) under a thin Python
layer that takes NumPy arrays and anything that speaks DLPack::

    import gradsync as gs
    comm = gs.Communicator()
    comm.allreduce_(grads, op="average")     # one fused message for the list
"""
from gradsync._mpi import check_same_mpi as _check_same_mpi
from gradsync._mpi import import_mpi as _import_mpi

MPI = _import_mpi()

from gradsync import _core  # noqa: E402

_check_same_mpi(MPI, _core)

from gradsync import elastic  # noqa: E402
from gradsync._core import (  # noqa: E402
    ArgumentError,
    ClosedError,
    DeviceArray,
    DtypeError,
    Error,
    MismatchError,
    PeerLostError,
    Request,
    TimeoutError,
    UnsupportedError,
    abandon_waits,
    bfloat16,
    call_options,
    dump_flight_record,
    empty_like,
    flight_on_signal,
    flight_record_capacity,
    flight_record_dir,
    flight_site_here,
    flight_stacks,
    flight_use_site,
    set_timeout,
    start_timeline,
    stop_timeline,
    to_device,
)
from gradsync._paths import get_include, get_library_dir  # noqa: E402
from gradsync._world import JoinError, init, world  # noqa: E402
from gradsync.arena import Arena  # noqa: E402
from gradsync.communicator import Communicator  # noqa: E402
from gradsync.kernels import accumulate_, accumulate_v2_, all_finite, scale_, zero_  # noqa: E402
from gradsync.ops import Op  # noqa: E402
from gradsync.partition import AllSumReduce, Partition, zero_volume_array  # noqa: E402
from gradsync.shard import ShardLayout  # noqa: E402
from gradsync.wire import WIRES, ErrorFeedback  # noqa: E402

__version__ = _core.version()

_THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}


def build_info():
    """What this gradsync was built with and runs on: MPI library and version,
    thread level, CUDA and NCCL versions ("13.0", "2.32.3"; None when absent),
    the GPU architectures compiled ("sm_80,sm_90,compute_90"; None without
    CUDA), the CUDA devices this process sees (and, when that is 0 because of
    a problem such as a driver older than the CUDA runtime, ``cuda_error``
    saying so), SIMD level and the default fusion threshold."""
    c = _core.build_info_c()
    return {
        "version": c["version"],
        "mpi_library": c["mpi_library_version"].splitlines()[0] if c["mpi_library_version"] else "",
        "mpi_library_version": c["mpi_library_version"],
        "mpi_library_path": c["mpi_library_path"],
        "mpi_version": "%d.%d" % MPI.Get_version(),
        "mpi_thread_level": _THREAD_LEVELS.get(c["mpi_thread_level"], "unknown"),
        "cuda": _cuda_version(c["cuda_version"]),
        "nccl": _nccl_version(c["nccl_version"]),
        "cuda_archs": c["cuda_archs"] or None,
        "cuda_devices": c["cuda_devices"],
        "cuda_error": c["cuda_error"],
        "simd": c["simd"],
        "fusion_threshold": c["default_fusion_threshold"],
        "check_payload_bytes": c["check_payload_bytes"],
    }


def _cuda_version(v):
    """CUDART_VERSION (1000 * major + 10 * minor) as "13.0"; None for 0."""
    return "%d.%d" % (v // 1000, v % 1000 // 10) if v else None


def _nccl_version(v):
    """NCCL_VERSION_CODE as "2.32.3": 10000 * major + 100 * minor + patch since
    2.9, 1000 * major + 100 * minor + patch before; None for 0."""
    if not v:
        return None
    if v >= 10000:
        return "%d.%d.%d" % (v // 10000, v % 10000 // 100, v % 100)
    return "%d.%d.%d" % (v // 1000, v % 1000 // 100, v % 100)


__all__ = [
    "AllSumReduce", "Arena", "ArgumentError", "ClosedError", "Communicator", "DeviceArray",
    "DtypeError", "Error", "ErrorFeedback", "JoinError", "MismatchError", "Op", "PeerLostError",
    "Request", "Partition", "ShardLayout", "TimeoutError", "UnsupportedError", "WIRES",
    "abandon_waits", "accumulate_", "accumulate_v2_", "all_finite", "bfloat16", "build_info",
    "call_options", "dump_flight_record", "elastic", "empty_like", "flight_on_signal",
    "flight_record_capacity", "flight_record_dir", "flight_site_here", "flight_stacks",
    "flight_use_site", "get_include",
    "get_library_dir", "init", "scale_", "set_timeout",
    "start_timeline", "stop_timeline", "to_device", "world", "zero_", "zero_volume_array",
]
