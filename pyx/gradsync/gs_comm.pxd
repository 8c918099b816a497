# Mirrors include/gs_comm.h.
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_call_options_t

cdef extern from "mpi.h" nogil:
    # Opaque here: only ever passed through by address.
    ctypedef struct _gs_opaque_mpi_comm:
        pass
    ctypedef _gs_opaque_mpi_comm *MPI_Comm "MPI_Comm"

cdef extern from "gs_comm.h" nogil:
    ctypedef struct gs_comm:
        pass
    ctypedef gs_comm *gs_comm_t

    ctypedef struct gs_config_t:
        size_t size
        int64_t fusion_threshold
        int check
        double stall_seconds
        int64_t direct_bytes

    # GS_CONFIG_INITIALIZER as an expression: every config starts from it.
    gs_config_t GS_CONFIG_DEFAULT "((gs_config_t)GS_CONFIG_INITIALIZER)"

    ctypedef struct gs_comm_stats_t:
        uint64_t calls
        uint64_t validations
        uint64_t rode_in_check
        uint64_t messages
        uint64_t bytes
        uint64_t hierarchical
        uint64_t peer_reads
        uint64_t hugepage_bytes

    gs_status_t gs_comm_get_stats(gs_comm_t comm, gs_comm_stats_t *stats)
    gs_status_t gs_comm_create(MPI_Comm mpi_comm, const gs_config_t *config, gs_comm_t *comm)
    gs_status_t gs_comm_set_world(MPI_Comm world)
    gs_status_t gs_comm_free(gs_comm_t *comm)
    gs_status_t gs_comm_split(gs_comm_t comm, int color, int key, gs_comm_t *out)
    gs_status_t gs_comm_rank(gs_comm_t comm, int *rank)
    gs_status_t gs_comm_size(gs_comm_t comm, int *size)
    gs_status_t gs_comm_local_rank(gs_comm_t comm, int *rank)
    gs_status_t gs_comm_local_size(gs_comm_t comm, int *size)
    gs_status_t gs_comm_mpi(gs_comm_t comm, MPI_Comm *mpi_comm)
    gs_status_t gs_comm_fusion_threshold(gs_comm_t comm, int64_t *bytes)
    gs_status_t gs_comm_set_fusion_threshold(gs_comm_t comm, int64_t bytes)
    gs_status_t gs_comm_check_enabled(gs_comm_t comm, int *enabled)
    gs_status_t gs_comm_ride_bytes(gs_comm_t comm, int64_t *bytes)
    gs_status_t gs_comm_abandon(gs_comm_t comm, gs_status_t status, const char *reason)
    gs_status_t gs_comm_device_transport(gs_comm_t comm, const char **name)
    gs_status_t gs_comm_cuda_stream(gs_comm_t comm, void **stream)
    gs_status_t gs_comm_cuda_order_after(gs_comm_t comm, uintptr_t stream)
    gs_status_t gs_barrier(gs_comm_t comm)
    ctypedef int (*gs_interrupt_check_t)() noexcept nogil
    void gs_set_interrupt_check(gs_interrupt_check_t check)
    void gs_set_timeout_seconds(double seconds)
    gs_status_t gs_comm_set_timeout(gs_comm_t comm, double seconds)
    gs_status_t gs_comm_timeout(gs_comm_t comm, double *seconds)
    gs_status_t gs_set_call_options(const gs_call_options_t *options)
    void gs_get_call_options(gs_call_options_t *options)
    const char *gs_mpi_library_version()
    const char *gs_mpi_library_path()
    int gs_mpi_thread_level()
