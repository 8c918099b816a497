# Mirrors include/gs_p2p.h.
from libc.stdint cimport int64_t
from gradsync.gs_async cimport gs_request_t
from gradsync.gs_comm cimport gs_comm_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_tensor_t

cdef extern from "gs_p2p.h" nogil:
    gs_status_t gs_p2p_max_tag(gs_comm_t comm, int *max_tag)
    gs_status_t gs_send(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int dest,
                        int tag)
    gs_status_t gs_recv(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int source,
                        int tag)
    gs_status_t gs_isend(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int dest,
                         int tag, gs_request_t *request)
    gs_status_t gs_irecv(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int source,
                         int tag, gs_request_t *request)
    int GS_ANY_SOURCE
    gs_status_t gs_recv_any(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int tag,
                            int *source)
    gs_status_t gs_irecv_any(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int tag,
                             int *source, gs_request_t *request)
    gs_status_t gs_p2p_probe(gs_comm_t comm, int source, int tag, int *found)
