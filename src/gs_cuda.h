/* gradsync private: the CUDA side of the runtime, callable from C. Not
 * installed.
 *
 * Three layers, bottom up:
 * - the launchers (cuda_kernels.cu; on a machine without a GPU,
 *   tests/emulated_cuda): each queues one kernel on a stream over tables
 *   that already sit in device memory, and returns;
 * - the device runtime (cuda_device.c): contexts entered by push and pop,
 *   gradsync's non-blocking communication stream per device, the calling
 *   thread's work stream, events and waits that poll (timeouts, interrupts,
 *   the runtime lock released), stream-ordered memory, sticky errors;
 * - the jobs (cuda_jobs.c): a host list of runs becomes work items, uploaded
 *   through pinned memory that is reused only after the kernel that read it
 *   has finished, then launched.
 * Nothing here waits for the device unless its comment says so. */
#ifndef GRADSYNC_CUDA_INTERNAL_H
#define GRADSYNC_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

gs_status_t gs_fail(gs_status_t status, const char *fmt, ...);

/* ---- the launchers (device tables; no host memory is read) ------------------ */

/* Elementwise jobs over a list of (a, b) runs. */
typedef enum gs_cu_mode {
  GS_CU_ZERO = 0,       /* a = +0 (b unused)                                    */
  GS_CU_COPY_SCALE = 1, /* a = b * scale, gs_cpu_scale_copy's arithmetic          */
  GS_CU_ACCUMULATE = 2, /* a += b, gs_accumulate's arithmetic (dtypes may differ) */
  GS_CU_OVERWRITE = 3   /* a = b cast to a's dtype, rounded once                  */
} gs_cu_mode_t;

typedef struct gs_cu_run {
  void *a;
  const void *b;
  int64_t count;
  int32_t adtype, bdtype;
} gs_cu_run_t;

/* A block's work: elements [first, first + count) of run (or slice) `run`. */
typedef struct gs_cu_item {
  int64_t run, first, count;
} gs_cu_item_t;

typedef struct gs_cu_slice {
  int64_t start, count;
} gs_cu_slice_t;

gs_status_t gs_cu_launch_elementwise(int mode, const gs_cu_run_t *runs, const gs_cu_item_t *items,
                                     int64_t nitems, double scale, void *stream);
/* *flag (device memory, zeroed by the caller) becomes 1 when any element of
 * the tensors (device array of descriptors) is NaN or infinite. */
gs_status_t gs_cu_launch_nonfinite(const gs_tensor_t *t, const gs_cu_item_t *items, int64_t nitems,
                                   int *flag, void *stream);
/* Adasum's dot products: partial[3k..] per item, then d[3j..3j+2] = <a,b>,
 * <a,a>, <b,b> of slice j summed over its items first_item[j] ..
 * first_item[j+1]-1 in order (a fixed order: deterministic). */
gs_status_t gs_cu_launch_dots(int dtype, const void *a, const void *b,
                              const gs_cu_slice_t *slices, const gs_cu_item_t *items,
                              int64_t nitems, const int64_t *first_item, int64_t nslices,
                              double *partial, double *d, void *stream);
/* out = coef[2j]*a + coef[2j+1]*b over slice j, gs_cpu_adasum_combine's arithmetic. */
gs_status_t gs_cu_launch_combine(int dtype, const void *a, const void *b, void *out,
                                 const gs_cu_slice_t *slices, const double *coef,
                                 const gs_cu_item_t *items, int64_t nitems, void *stream);
/* Order keys for NaN-propagating min/max over an integer reduction
 * (cuda_pieces.cuh): forward, floats -> keys (gs_cu_key_dtype wide), or
 * inverse, keys -> floats. */
gs_status_t gs_cu_launch_order_keys(int dtype, int max, int inverse, const void *src, void *dst,
                                    int64_t count, void *stream);
/* The unsigned integer dtype keys of `dtype` take: 4 or 8 bytes. */
static inline int gs_cu_key_bytes(gs_dtype_t dtype) { return dtype == GS_FLOAT64 ? 8 : 4; }

/* ---- the device runtime (cuda_device.c) --------------------------------------- */

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

/* gradsync's communication stream on `device` (non-blocking: it never waits
 * for, nor holds up, the legacy default stream). The device must be entered. */
gs_status_t gs_cu_comm_stream(int device, void **stream);
/* The calling thread's work stream (gs_cuda_set_stream; the legacy default
 * stream unless set): where the kernels API runs and what collectives are
 * ordered after. */
void *gs_cu_work_stream(void);
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
 * freed, the work queued on `stream` (its only user) is waited for. */
gs_status_t gs_cu_grow_pinned(void **buf, size_t *have, size_t need, void *stream);
void gs_cu_release(void *buf, int pinned);
/* Asynchronous copy on the stream (any direction; host memory pinned). */
gs_status_t gs_cu_copy(void *dst, const void *src, size_t bytes, void *stream);

/* A CUDA error as a status naming `what`; a sticky error (the context is
 * lost: illegal address, launch failure, ...) also marks the current
 * communicator unusable. */
gs_status_t gs_cu_fail(int cuda_error, const char *what);

/* ---- the jobs (cuda_jobs.c): host lists in, one launch each ----------------------- */

gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n,
                              double scale, void *stream);
/* *bad = 1 when any element is NaN or infinite; waits for `stream` (polls). */
gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *stream);
/* Adasum's local math over `n` slices of two buffers (slice j: elements
 * [start[j], start[j]+count[j]) of a and b, the same offsets in out). dots:
 * host d[3j..3j+2] receives the products (waits for `stream`, polling).
 * combine: out = coef[2j]*a + coef[2j+1]*b. */
gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b,
                              const int64_t *start, const int64_t *count, int64_t n,
                              double *d, void *stream);
gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count,
                                 const double *coef, int64_t n, void *stream);

#ifdef __cplusplus
}
#endif
#endif
