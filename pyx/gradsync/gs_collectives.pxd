# Mirrors include/gs_collectives.h.
from libc.stdint cimport int64_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_tensor_t, gs_op_t, gs_wire_t
from gradsync.gs_comm cimport gs_comm_t

cdef extern from "gs_collectives.h" nogil:
    gs_status_t gs_allreduce(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                             int64_t n, gs_op_t op, double prescale, double postscale)
    gs_status_t gs_allreduce_wire(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                                  int64_t n, gs_op_t op, double prescale, double postscale,
                                  gs_wire_t wire, const gs_tensor_t *residual)
    gs_status_t gs_broadcast(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int root)
    gs_status_t gs_allgather_counts(gs_comm_t comm, const gs_tensor_t *inp, int64_t n,
                                    const int64_t *row_elems, int64_t *counts_out)
    gs_status_t gs_allgather_rows(gs_comm_t comm, const gs_tensor_t *inp, int64_t n,
                                  const int64_t *rows, const int64_t *row_elems,
                                  int64_t *rows_out)
    gs_status_t gs_allgatherv(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                              int64_t n, const int64_t *counts)
    gs_status_t gs_reduce_scatter(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                                  int64_t n, const int64_t *rows, gs_op_t op,
                                  double prescale, double postscale)
    gs_status_t gs_block_range(int64_t rows, int64_t row_elems, int size, int rank,
                               int64_t *first, int64_t *count)
    gs_status_t gs_alltoall_counts(gs_comm_t comm, const gs_tensor_t *inp, int64_t n,
                                   const int64_t *row_elems, const int64_t *send_counts,
                                   int64_t *recv_counts)
    gs_status_t gs_alltoallv(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                             int64_t n, const int64_t *send_counts, const int64_t *recv_counts)
    gs_status_t gs_gatherv(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                           int64_t n, const int64_t *counts, int root)
    gs_status_t gs_scatterv(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                            int64_t n, const int64_t *counts, int root)
    gs_status_t gs_reduce(gs_comm_t comm, const gs_tensor_t *inp, const gs_tensor_t *out,
                          int64_t n, gs_op_t op, double prescale, double postscale, int root)
