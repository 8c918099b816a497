# Mirrors include/gs_async.h.
from libc.stdint cimport int64_t, uintptr_t
from gradsync.gs_comm cimport gs_comm_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_op_t, gs_tensor_t, gs_wire_t

cdef extern from "gs_async.h" nogil:
    ctypedef struct gs_request:
        pass
    ctypedef gs_request *gs_request_t

    gs_status_t gs_allreduce_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                   gs_op_t op, double prescale, double postscale,
                                   gs_request_t *request)
    gs_status_t gs_allreduce_wire_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                        gs_op_t op, double prescale, double postscale,
                                        gs_wire_t wire, const gs_tensor_t *residual,
                                        gs_request_t *request)
    gs_status_t gs_broadcast_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                   int root, gs_request_t *request)
    gs_status_t gs_allgather_shards_async(gs_comm_t comm, const gs_tensor_t *tensors,
                                          int64_t n, gs_request_t *request)
    gs_status_t gs_reduce_scatter_shards_async(gs_comm_t comm, const gs_tensor_t *tensors,
                                               int64_t n, gs_op_t op, double prescale,
                                               double postscale, gs_request_t *request)
    gs_status_t gs_request_test(gs_request_t request, int *done)
    gs_status_t gs_request_wait(gs_request_t request)
    gs_status_t gs_request_wait_stream(gs_request_t request, uintptr_t stream)
    gs_status_t gs_request_stream(gs_request_t request, void **stream)
    gs_status_t gs_request_free(gs_request_t *request)
    int64_t gs_requests_pending()
    gs_status_t gs_allgatherv_async(gs_comm_t comm, const gs_tensor_t *inp,
                                    const gs_tensor_t *out, int64_t n, const int64_t *counts,
                                    gs_request_t *request)
    gs_status_t gs_reduce_scatter_async(gs_comm_t comm, const gs_tensor_t *inp,
                                        const gs_tensor_t *out, int64_t n, const int64_t *rows,
                                        gs_op_t op, double prescale, double postscale,
                                        gs_request_t *request)
    gs_status_t gs_alltoallv_async(gs_comm_t comm, const gs_tensor_t *inp,
                                   const gs_tensor_t *out, int64_t n,
                                   const int64_t *send_counts, const int64_t *recv_counts,
                                   gs_request_t *request)
    gs_status_t gs_gatherv_async(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                                 int64_t n, const int64_t *counts, int root,
                                 gs_request_t *request)
    gs_status_t gs_scatterv_async(gs_comm_t comm, const gs_tensor_t *inp,
                                  const gs_tensor_t *out, int64_t n, const int64_t *counts,
                                  int root, gs_request_t *request)
    gs_status_t gs_reduce_async(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                                int64_t n, gs_op_t op, double prescale, double postscale,
                                int root, gs_request_t *request)
