# Mirrors include/gs_status.h.
cdef extern from "gs_status.h" nogil:
    ctypedef enum gs_status_t:
        GS_SUCCESS
        GS_ERR_INVALID_ARGUMENT
        GS_ERR_TYPE
        GS_ERR_MISMATCH
        GS_ERR_MPI
        GS_ERR_NO_MEMORY
        GS_ERR_UNSUPPORTED
        GS_ERR_INTERNAL
        GS_ERR_CLOSED
        GS_ERR_CUDA
        GS_ERR_NCCL
        GS_ERR_TIMEOUT
        GS_ERR_INTERRUPTED
        GS_ERR_PEER_LOST

    const char *gs_status_string(gs_status_t status)
    const char *gs_last_error()
    int gs_last_lost_ranks(int *ranks, int max)
