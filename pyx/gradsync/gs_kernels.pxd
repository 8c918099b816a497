# Mirrors include/gs_kernels.h.
from libc.stdint cimport int64_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_tensor_t

cdef extern from "gs_kernels.h" nogil:
    gs_status_t gs_zero(const gs_tensor_t *tensors, int64_t n)
    gs_status_t gs_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                              int overwrite)
    gs_status_t gs_all_finite(const gs_tensor_t *tensors, int64_t n, int *finite)
    gs_status_t gs_scale(const gs_tensor_t *tensors, int64_t n, double factor)
