/* gradsync private, device/ (a layer: docs/ARCHITECTURE.md): the CUDA side of the runtime,
 * callable from C. Over the launchers (kernels/gs_kernels.h), two parts:
 * - the device runtime (cuda.c, memory.c): contexts entered by push and pop,
 *   a non-blocking stream per communicator, each device's entry stream, the
 *   calling thread's work stream, events and waits that poll (timeouts, interrupts,
 *   the runtime lock released), stream-ordered memory, sticky errors;
 * - the kernel-table ring (ring.c): pinned memory and its device
 *   mirror, a region reused only after the kernel that read it has
 *   finished; pinned buffers for results the host reads back;
 * - the jobs (jobs.c): a host list of runs becomes work items, uploaded
 *   through the ring, then launched.
 * Nothing here waits for the device unless its comment says so. */
#ifndef GRADSYNC_CUDA_INTERNAL_H
#define GRADSYNC_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "gs_device.h"
#include "runtime/gs_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the device runtime (cuda.c, memory.c) ------------------------------------ */

/* A device made current for the length of a call, through its primary
 * context: gs_cu_leave restores exactly what the thread had, which may be
 * no context at all (a thread gradsync started, or one that never used
 * CUDA): gradsync never creates a context the caller did not have. */
typedef struct gs_cu_scope {
  int device;
  int pushed;
} gs_cu_scope_t;
gs_status_t gs_cu_enter(int device, gs_cu_scope_t *scope);
void gs_cu_leave(gs_cu_scope_t *scope);
/* For calls that name no device (pinned host memory, pointer queries),
 * which would otherwise create a primary context on the current device
 * (device 0 on a thread that never chose one): keeps the thread's current
 * context, else enters a primary context the process already has (the
 * current device's first). *none = 1 when the process has no context at
 * all; then nothing is entered, and gs_cu_leave is still called. */
gs_status_t gs_cu_enter_existing(gs_cu_scope_t *scope, int *none);

/* A communicator's stream, on the entered device: non-blocking (it never
 * waits for, nor holds up, the legacy default stream). Every communicator
 * has its own: NCCL kernels block until all ranks join, so communicators
 * sharing a stream deadlock when ranks issue their calls in different
 * orders. gs_cu_stream_destroy returns at once; CUDA frees the stream after
 * the work queued on it. */
gs_status_t gs_cu_stream_create(void **stream, const char *what);
void gs_cu_stream_destroy(void *stream);
/* `stream` runs its later work after the work queued so far on `device`'s
 * entry stream (gs_cuda_stream, gs_cuda_order_after), if anyone made one.
 * The device must be entered. */
gs_status_t gs_cu_follow_entry(int device, void *stream);
/* gradsync's stream on `device` for long-lived allocations (non-blocking,
 * nothing else queued there): an event recorded after an allocation on it
 * completes at once, so other streams are ordered after the allocation
 * without waiting for anyone's work. The device must be entered. */
gs_status_t gs_cu_alloc_stream(int device, void **stream);
/* gradsync's memory stream on `device` (non-blocking, never destroyed):
 * where gs_mem_t memory is allocated and freed. The device must be entered. */
gs_status_t gs_cu_memory_stream(int device, void **stream);
/* The calling thread's work stream (gs_cuda_set_stream; the legacy default
 * stream unless set): where the kernels API runs and what collectives are
 * ordered after. Read only inside a call that set it. */
void *gs_cu_work_stream(void);
/* A key naming `stream` for the life of the process (cudaStreamGetId: a
 * handle may be reused by a stream created after it was destroyed). */
gs_status_t gs_cu_stream_key(void *stream, unsigned long long *key);
/* A stream as the public API numbers them (0 or 1: legacy default, 2: per
 * thread, else a cudaStream_t). */
void *gs_cu_as_stream(uintptr_t stream);
/* `waiter` runs its later work after everything queued on `producer` so far. */
gs_status_t gs_cu_order(void *waiter, void *producer, const char *what);

/* Events, from a pool. */
gs_status_t gs_cu_record(void *stream, void **event, const char *what);
void gs_cu_event_free(void *event);
/* 1: the event's work finished; 0: not yet; -1: a CUDA error (recorded,
 * naming `what`; a sticky one marks the current communicator unusable). */
int gs_cu_event_poll(void *event, const char *what);
/* Waits on the host for the event, polling with the runtime lock released,
 * GRADSYNC_TIMEOUT_SECONDS and interrupts honoured (gs_progress_wait). */
gs_status_t gs_cu_event_wait(void *event, const char *what);
/* `stream` runs its later work after the event (no host wait). */
gs_status_t gs_cu_stream_wait_event(void *stream, void *event, const char *what);
/* Records an event on `stream` and waits for it (gs_cu_event_wait). */
gs_status_t gs_cu_stream_wait(void *stream, const char *what);

/* Device memory in stream order: allocated and freed on `stream`, so a free
 * never waits and never cuts off work queued before it. */
gs_status_t gs_cu_malloc_async(void **ptr, size_t bytes, void *stream, const char *what);
void gs_cu_free_async(void *ptr, void *stream);
/* A device buffer of at least `need` bytes (grows geometrically; the old one
 * freed in stream order). */
gs_status_t gs_cu_grow(void **buf, size_t *have, size_t need, void *stream);
/* A pinned host buffer of at least `need` bytes; before an old one is
 * given back, the work queued on `stream` (its only user) is waited for
 * (polling). Pinned buffers are never freed while gradsync runs
 * (cudaFreeHost waits for the whole device): a released one is reused. */
gs_status_t gs_cu_grow_pinned(void **buf, size_t *have, size_t need, void *stream);
/* Gives back a gs_cu_grow_pinned buffer no queued work uses any more. */
void gs_cu_release(void *buf);
/* Asynchronous copy on the stream (any direction; host memory pinned). */
gs_status_t gs_cu_copy(void *dst, const void *src, size_t bytes, void *stream);

/* A CUDA error as a status naming `what`; a sticky error (the context is
 * lost: illegal address, launch failure, ...) also marks the current
 * communicator unusable. */
gs_status_t gs_cu_fail(int cuda_error, const char *what);
/* A launcher's return (0 or a CUDA error) as a status. */
static inline gs_status_t gs_cu_launched(int cuda_error, const char *what) {
  return cuda_error ? gs_cu_fail(cuda_error, what) : GS_SUCCESS;
}

/* ---- the kernel-table ring and result buffers (ring.c) --------------------------- */

/* Room for one kernel table on the current device: `len` bytes of pinned
 * host memory and their device mirror, usable on `stream`. Open returns
 * with the ring's lock held; the table is filled, uploaded and launched on
 * `stream`, then close records the event after the launch (the region is
 * reused once it completes) and releases the lock. A full ring grows, or,
 * past its bound, open waits (polling with the lock released:
 * GRADSYNC_TIMEOUT_SECONDS, interrupts). */
typedef struct gs_cu_table {
  void *ring, *arena;
  size_t off, len;
  char *host, *dev;
  int sent; /* set once device work reading the table is queued */
} gs_cu_table_t;
gs_status_t gs_cu_table_open(size_t len, void *stream, gs_cu_table_t *t);
gs_status_t gs_cu_table_close(gs_cu_table_t *t, void *stream);

/* A pinned host buffer of at least `bytes`, the call's own, for results the
 * host reads back (kept out of the ring, so no ring region waits for a
 * reader). fetch queues the copy of device bytes into it on `stream`
 * (before the table holding them is closed); read waits for the copy
 * (polling, gs_cu_event_wait), copies `bytes` to `out` and gives the buffer
 * back; put gives it back unread. A buffer whose copy was not seen to
 * finish is reused only once it has. */
typedef struct gs_cu_result gs_cu_result_t;
gs_status_t gs_cu_result_get(size_t bytes, gs_cu_result_t **r);
gs_status_t gs_cu_result_fetch(gs_cu_result_t *r, const void *src, size_t bytes, void *stream);
gs_status_t gs_cu_result_read(gs_cu_result_t *r, void *out, size_t bytes, const char *what);
/* The other way: `bytes` of host memory at `src` copied into the buffer at
 * once, and from there to device memory `dst` on `stream`; the buffer is
 * reused only once that copy has run. */
gs_status_t gs_cu_result_upload(gs_cu_result_t *r, void *dst, const void *src, size_t bytes,
                                void *stream);
void gs_cu_result_put(gs_cu_result_t *r);

/* ---- the jobs (jobs.c): host lists in, one launch each ---------------------------- */

gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n, double scale,
                              void *stream);
/* *bad = 1 when any element is NaN or infinite; waits for `stream` (polls). */
gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *stream);
/* Adasum's local math over `n` slices of two buffers (slice j: elements
 * [start[j], start[j]+count[j]) of a and b, the same offsets in out). dots:
 * host d[3j..3j+2] receives the products (waits for `stream`, polling).
 * combine: out = coef[2j]*a + coef[2j+1]*b. */
gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, const int64_t *start,
                              const int64_t *count, int64_t n, double *d, void *stream);
gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count, const double *coef,
                                 int64_t n, void *stream);

/* One pass of the wire allreduce (gs_cu_launch_wire_*) over job.runs, a
 * host array: encode (dst: packed), reduce (src: received shards, dst:
 * packed) or decode (src: gathered shards). */
typedef enum { GS_CU_WIRE_ENCODE, GS_CU_WIRE_REDUCE, GS_CU_WIRE_DECODE } gs_cu_wire_pass_t;
gs_status_t gs_cu_wire_pass(gs_cu_wire_pass_t pass, gs_cu_wire_job_t job, const void *src,
                            void *dst, void *stream);

/* ---- the gradient kernels on CUDA memory (kernels.c) --------------------------
 * On the calling thread's work stream, no host wait (gs_all_finite reads
 * its answer, polling). Arguments are checked by coll/kernels.c. */
gs_status_t gs_device_zero(const gs_tensor_t *t, int64_t n);
gs_status_t gs_device_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                                 int overwrite);
gs_status_t gs_device_all_finite(const gs_tensor_t *t, int64_t n, int *finite);
gs_status_t gs_device_scale(const gs_tensor_t *t, int64_t n, double factor);

#ifdef __cplusplus
}
#endif
#endif
