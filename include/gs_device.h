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
 * memory is pinned (portable: every context sees it pinned), and CUDA
 * memory comes from device.id's stream-ordered pool (cudaMallocAsync) in
 * the order of `stream` (numbered as gs_cuda_set_stream's, on device.id;
 * ignored for host memory): use it in that stream's order, or on other
 * streams after an event recorded there. gs_free_on frees it in the order
 * of `stream`, which must by then be ordered after every use. gs_malloc and
 * gs_free are these on the legacy default stream (which always exists).
 * bytes == 0 gives a valid pointer that must still be freed. Pinned memory
 * is allocated in the thread's current context, else in a context the
 * process already has (gradsync never creates one on a device the process
 * does not use), else in the current device's. */
GS_API gs_status_t gs_malloc_on(gs_device_t device, size_t bytes, uintptr_t stream, void **ptr);
GS_API gs_status_t gs_free_on(gs_device_t device, void *ptr, uintptr_t stream);
GS_API gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr);
GS_API gs_status_t gs_free(gs_device_t device, void *ptr);
/* Copies bytes between any two kinds of memory, on the legacy default
 * stream after the work queued so far on the thread's work stream; the
 * work stream's later work follows the copy. Host memory is read (and
 * written) before it returns; a copy into device memory may still be
 * running on the device when it returns, in those streams' order. */
GS_API gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                             gs_device_t src_device, size_t bytes);

/* ---- memory that keeps a record of the streams using it (gs_mem_t) -----------
 * What gradsync.DeviceArray is made of, for C users too. CUDA memory is
 * allocated on gradsync's memory stream of the device (non-blocking; it
 * always exists), and an event marks the allocation ready. Every use on a
 * stream is recorded as an event on that stream at the time of the use
 * (gs_mem_use), never later: the stream may be gone by the time the memory
 * is freed. gs_mem_free makes the memory stream wait for every recorded use
 * before freeing in its order; nothing waits on the host. Host memory
 * (CPU, CUDA_HOST) has no stream order: the calls below do nothing for it
 * but allocate and free. A gs_mem_t is used by one thread at a time. */
typedef struct gs_mem *gs_mem_t;
GS_API gs_status_t gs_mem_alloc(gs_device_t device, size_t bytes, gs_mem_t *mem);
GS_API void *gs_mem_ptr(gs_mem_t mem);
/* `stream` (numbered as gs_cuda_set_stream's) waits, with no host wait,
 * for the last recorded write to each of the n memories (writes != 0: for
 * every recorded use, as whoever writes must). stream 0: the host waits
 * instead (polling, with GRADSYNC_TIMEOUT_SECONDS and interrupts). */
GS_API gs_status_t gs_mem_order(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes);
/* Work just queued on `stream` uses each of the n memories (writes != 0:
 * writes them): one event recorded there now marks it, for gs_mem_order
 * and gs_mem_free. */
GS_API gs_status_t gs_mem_use(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes);
/* A stream a consumer can wait on for every recorded use (the CUDA array
 * interface's 'stream'): gradsync's memory stream, made to wait for them,
 * or 0 when nothing recorded is still pending. */
GS_API gs_status_t gs_mem_stream(gs_mem_t mem, uintptr_t *stream);
/* Frees after every recorded use; *mem becomes NULL. */
GS_API gs_status_t gs_mem_free(gs_mem_t *mem);

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
/* `waiter` runs its later work after everything queued so far on
 * `producer` (both streams of `device`, numbered as above); an event, no
 * host wait. */
GS_API gs_status_t gs_cuda_stream_order(int device, uintptr_t waiter, uintptr_t producer);

/* The calling thread's work stream (see above): a cudaStream_t, or 0 and 1
 * for the legacy default stream, 2 for the per-thread default stream. */
GS_API gs_status_t gs_cuda_set_stream(uintptr_t stream);
GS_API uintptr_t gs_cuda_get_stream(void);

#ifdef __cplusplus
}
#endif
#endif
