# cython: language_level=3
"""An extension outside gradsync that calls gradsync's C API on the
communicator of a Python ``gradsync.Communicator`` (tests/embed builds it
from gradsync.get_include() and gradsync.get_library_dir(), cimporting the
.pxd files that ship in the package)."""
from libc.stdint cimport int64_t, uintptr_t

from gradsync.gs_collectives cimport gs_allreduce
from gradsync.gs_comm cimport gs_comm_rank, gs_comm_size, gs_comm_t
from gradsync.gs_info cimport gs_version
from gradsync.gs_status cimport GS_SUCCESS, gs_last_error, gs_status_string, gs_status_t
from gradsync.gs_types cimport (GS_DEVICE_CPU, GS_FLOAT32, GS_FLOAT64, GS_OP_SUM, gs_dtype_t,
                                gs_tensor_t)


cdef gs_comm_t comm_of(communicator) except NULL:
    """The gs_comm_t a gradsync.Communicator holds (borrowed: it stays the
    Communicator's)."""
    return <gs_comm_t><uintptr_t>communicator.c_handle


cdef int check(gs_status_t s, what) except -1:
    if s != GS_SUCCESS:
        raise RuntimeError(f"{what}: {gs_status_string(s).decode()}: {gs_last_error().decode()}")
    return 0


cdef gs_tensor_t host_tensor(void *data, int64_t count, gs_dtype_t dtype) noexcept:
    cdef gs_tensor_t t
    t.data = data
    t.count = count
    t.dtype = dtype
    t.device.kind = GS_DEVICE_CPU
    t.device.id = 0
    return t


def rank_and_size(communicator):
    """(rank, size) as the C API reports them."""
    cdef int rank = -1, size = -1
    cdef gs_comm_t comm = comm_of(communicator)
    check(gs_comm_rank(comm, &rank), "gs_comm_rank")
    check(gs_comm_size(comm, &size), "gs_comm_size")
    return rank, size


def version():
    return gs_version().decode()


def allreduce_sum_(communicator, double[::1] x, float[::1] y):
    """Sums a float64 and a float32 array over ranks in place, in one
    gs_allreduce call (one fused message), without the GIL."""
    cdef gs_comm_t comm = comm_of(communicator)
    cdef gs_tensor_t t[2]
    cdef gs_status_t s
    t[0] = host_tensor(&x[0] if x.shape[0] else NULL, x.shape[0], GS_FLOAT64)
    t[1] = host_tensor(&y[0] if y.shape[0] else NULL, y.shape[0], GS_FLOAT32)
    with nogil:
        s = gs_allreduce(comm, t, NULL, 2, GS_OP_SUM, 1.0, 1.0)
    check(s, "gs_allreduce")
