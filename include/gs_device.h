/* gradsync: memory on host and CUDA devices, and the streams gradsync uses.
 *
 * Each thread has a work stream (gs_cuda_set_stream; the legacy default
 * stream unless set), the stream a framework would call current. The
 * gradient kernels on CUDA memory run on it and return at once, like the
 * framework's own ops (gs_all_finite waits for its answer). A collective on
 * CUDA memory runs on its communicator's own stream (gs_comm_cuda_stream,
 * non-blocking: it never waits for or holds up the legacy default stream),
 * ordered after the work queued so far on the caller's work stream by an
 * event, and returns once its results are in place (asynchronous
 * collectives: gs_request_wait_stream). One stream per communicator, not
 * per device: NCCL kernels block until every rank joins, so communicators
 * sharing a stream would deadlock when threads issue their calls in
 * different orders on different ranks. */
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
 * driver or a device. A driver older than the CUDA runtime gradsync was
 * built with is an error (GS_ERR_CUDA) naming both versions. */
GS_API gs_status_t gs_cuda_device_count(int *count);
/* The calling thread's current CUDA device. */
GS_API gs_status_t gs_cuda_get_device(int *device);

/* Where `ptr` points: *device receives its kind and CUDA ordinal (CUDA for
 * device memory, CUDA_HOST for pinned or managed-on-host, CPU for memory CUDA
 * does not know). */
GS_API gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device);

/* `bytes` of memory on `device`: CPU memory is 64-byte aligned, CUDA_HOST
 * memory is pinned, and CUDA memory comes from device.id's stream-ordered
 * pool (cudaMallocAsync) on the thread's work stream: use it in that
 * stream's order (other streams after an event). gs_free of CUDA memory
 * frees it in the order of the thread's work stream. bytes == 0 gives a
 * valid pointer that must still be freed. */
GS_API gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr);
GS_API gs_status_t gs_free(gs_device_t device, void *ptr);
/* Copies bytes between any two kinds of memory, after the work queued so
 * far on the thread's work stream; returns when done. */
GS_API gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                             gs_device_t src_device, size_t bytes);

/* The device's entry stream (a cudaStream_t, non-blocking, made on first
 * use): every later collective on `device`, of every communicator, follows
 * the work queued on it so far. gradsync queues none of its own work there:
 * to wait for collectives, use the communicator's stream
 * (gs_comm_cuda_stream) or the request's (gs_request_stream). Once it
 * exists, each collective on the device pays one more event. */
GS_API gs_status_t gs_cuda_stream(int device, void **stream);
/* Every later collective on `device`, of every communicator, follows
 * everything queued so far on `stream` (a cudaStream_t; 1: the legacy
 * default stream, 2: the per-thread default stream, as DLPack numbers
 * them), through the entry stream. gs_comm_cuda_order_after does this for
 * one communicator. */
GS_API gs_status_t gs_cuda_order_after(int device, uintptr_t stream);

/* The calling thread's work stream (see above): a cudaStream_t, or 0 and 1
 * for the legacy default stream, 2 for the per-thread default stream. */
GS_API gs_status_t gs_cuda_set_stream(uintptr_t stream);
GS_API uintptr_t gs_cuda_get_stream(void);

#ifdef __cplusplus
}
#endif
#endif
