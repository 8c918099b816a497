# Mirrors include/gs_device.h.
from libc.stdint cimport uintptr_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_device_t

cdef extern from "gs_device.h" nogil:
    int gs_cuda_built()
    const char *gs_cuda_archs()
    gs_status_t gs_cuda_device_count(int *count)
    gs_status_t gs_cuda_get_device(int *device)
    gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device)

    gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr)
    gs_status_t gs_free(gs_device_t device, void *ptr)
    gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                          gs_device_t src_device, size_t bytes)

    gs_status_t gs_cuda_stream(int device, void **stream)
    gs_status_t gs_cuda_order_after(int device, uintptr_t stream)
    gs_status_t gs_cuda_set_stream(uintptr_t stream)
    uintptr_t gs_cuda_get_stream()
