# Mirrors include/gs_types.h.
from libc.stdint cimport int32_t, int64_t, uint64_t

cdef extern from "gs_types.h" nogil:
    ctypedef enum gs_dtype_t:
        GS_FLOAT16
        GS_BFLOAT16
        GS_FLOAT32
        GS_FLOAT64
        GS_INT8
        GS_UINT8
        GS_INT32
        GS_INT64
    enum: GS_NUM_DTYPES

    ctypedef enum gs_op_t:
        GS_OP_SUM
        GS_OP_AVERAGE
        GS_OP_MIN
        GS_OP_MAX
        GS_OP_PROD
        GS_OP_ADASUM
        GS_OP_ADASUM_HIERARCHICAL
    enum: GS_NUM_OPS

    ctypedef enum gs_wire_t:
        GS_WIRE_NONE
        GS_WIRE_BFLOAT16
        GS_WIRE_FLOAT16
        GS_WIRE_FLOAT8_E4M3
        GS_WIRE_FLOAT8_E5M2
    enum: GS_NUM_WIRES
    enum: GS_WIRE_BLOCK

    ctypedef enum gs_device_kind_t:
        GS_DEVICE_CPU
        GS_DEVICE_CUDA
        GS_DEVICE_CUDA_HOST

    ctypedef struct gs_device_t:
        gs_device_kind_t kind
        int32_t id

    ctypedef struct gs_tensor_t:
        void *data
        int64_t count
        gs_dtype_t dtype
        gs_device_t device

    ctypedef struct gs_call_options_t:
        uint64_t tag
        double timeout

    size_t gs_dtype_size(gs_dtype_t dtype)
    const char *gs_dtype_name(gs_dtype_t dtype)
    const char *gs_wire_name(gs_wire_t wire)
    const char *gs_op_name(gs_op_t op)
