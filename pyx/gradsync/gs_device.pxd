# Mirrors include/gs_device.h.
from libc.stdint cimport int64_t, uintptr_t
from gradsync.gs_status cimport gs_status_t
from gradsync.gs_types cimport gs_device_t

cdef extern from "gs_device.h" nogil:
    int gs_cuda_built()
    const char *gs_cuda_archs()
    gs_status_t gs_cuda_device_count(int *count)
    gs_status_t gs_cuda_get_device(int *device)
    gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device)

    gs_status_t gs_malloc_on(gs_device_t device, size_t bytes, uintptr_t stream, void **ptr)
    gs_status_t gs_free_on(gs_device_t device, void *ptr, uintptr_t stream)
    gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr)
    gs_status_t gs_free(gs_device_t device, void *ptr)
    gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                          gs_device_t src_device, size_t bytes)

    ctypedef struct gs_mem:
        pass
    ctypedef gs_mem *gs_mem_t
    gs_status_t gs_mem_alloc(gs_device_t device, size_t bytes, gs_mem_t *mem)
    void *gs_mem_ptr(gs_mem_t mem)
    gs_status_t gs_mem_order(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes)
    gs_status_t gs_mem_use(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes)
    gs_status_t gs_mem_stream(gs_mem_t mem, uintptr_t *stream)
    gs_status_t gs_mem_free(gs_mem_t *mem)

    gs_status_t gs_cuda_stream(int device, void **stream)
    gs_status_t gs_cuda_order_after(int device, uintptr_t stream)
    gs_status_t gs_cuda_stream_order(int device, uintptr_t waiter, uintptr_t producer)
    gs_status_t gs_cuda_set_stream(uintptr_t stream)
    uintptr_t gs_cuda_get_stream()
