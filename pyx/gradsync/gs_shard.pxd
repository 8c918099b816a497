# Mirrors include/gs_shard.h.
from libc.stdint cimport int64_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_tensor_t, gs_op_t
from gradsync.gs_comm cimport gs_comm_t

cdef extern from "gs_shard.h" nogil:
    ctypedef struct gs_shard_layout_t:
        int64_t total
        int64_t padded
        int64_t rank_count

    gs_status_t gs_shard_layout(const int64_t *counts, int64_t n, int size,
                                gs_shard_layout_t *layout, int64_t *offsets, int *owners)
    gs_status_t gs_allgather_shards(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n)
    gs_status_t gs_reduce_scatter_shards(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                         gs_op_t op, double prescale, double postscale)
