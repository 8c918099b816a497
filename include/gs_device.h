/* gradsync: memory on host and CUDA devices, and the stream gradsync works on.
 *
 * Device calls are synchronous for the caller: a collective or kernel on CUDA
 * memory returns once its results are in place. gradsync queues its work on
 * one stream per device (gs_cuda_stream), created as a blocking stream so it
 * is ordered after work on the legacy default stream; callers using other
 * streams order gradsync after them with gs_cuda_order_after (the Python
 * layer does this through DLPack's `stream` argument). */
#ifndef GRADSYNC_DEVICE_H
#define GRADSYNC_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this library was compiled with CUDA support. */
GS_API int gs_cuda_built(void);
/* The GPU architectures compiled in, e.g. "sm_80,sm_90,compute_90"; "" without CUDA. */
GS_API const char *gs_cuda_archs(void);
/* CUDA devices visible to this process; 0 (and success) without CUDA, a
 * driver or a device. */
GS_API gs_status_t gs_cuda_device_count(int *count);
/* The calling thread's current CUDA device. */
GS_API gs_status_t gs_cuda_get_device(int *device);

/* Where `ptr` points: *device receives its kind and CUDA ordinal (CUDA for
 * device memory, CUDA_HOST for pinned or managed-on-host, CPU for memory CUDA
 * does not know). */
GS_API gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device);

/* `bytes` of memory on `device`: CPU memory is 64-byte aligned, CUDA memory
 * comes from cudaMalloc on device.id, CUDA_HOST memory is pinned. bytes == 0
 * gives a valid pointer that must still be freed. */
GS_API gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr);
GS_API gs_status_t gs_free(gs_device_t device, void *ptr);
/* Copies bytes between any two kinds of memory; returns when done. */
GS_API gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                             gs_device_t src_device, size_t bytes);

/* The stream gradsync queues its work on for `device` (a cudaStream_t). */
GS_API gs_status_t gs_cuda_stream(int device, void **stream);
/* gradsync's stream on `device` waits for everything queued so far on
 * `stream` (a cudaStream_t; 1: the legacy default stream, 2: the per-thread
 * default stream, as DLPack numbers them). */
GS_API gs_status_t gs_cuda_order_after(int device, uintptr_t stream);

#ifdef __cplusplus
}
#endif
#endif
