/* gradsync private: the CUDA side of the runtime, callable from C. The
 * kernels (cuda_kernels.cu) and the device bookkeeping (cuda_device.c) exist
 * only in builds with GS_HAVE_CUDA; callers test gs_cuda_built() or the
 * tensors' device first. Every launcher queues on `stream` and does not
 * wait; the caller synchronizes once at the end of its call. Not installed. */
#ifndef GRADSYNC_CUDA_INTERNAL_H
#define GRADSYNC_CUDA_INTERNAL_H

#include <stdint.h>

#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

gs_status_t gs_fail(gs_status_t status, const char *fmt, ...);

/* Elementwise jobs over a list of (a, b) runs, in one launch. */
typedef enum gs_cu_mode {
  GS_CU_ZERO = 0,       /* a = +0 (b unused)                                  */
  GS_CU_COPY_SCALE = 1, /* a = b * scale, gs_cpu_scale_copy's arithmetic        */
  GS_CU_ACCUMULATE = 2, /* a += b, gs_accumulate's arithmetic (dtypes may differ) */
  GS_CU_OVERWRITE = 3   /* a = b cast to a's dtype, rounded once                */
} gs_cu_mode_t;

typedef struct gs_cu_run {
  void *a;
  const void *b;
  int64_t count;
  int32_t adtype, bdtype;
} gs_cu_run_t;

gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n,
                              double scale, void *stream);
/* *bad = 1 when any element of the tensors is NaN or infinite; waits. */
gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *stream);

/* Adasum's local math over `n` slices of two buffers (slice j: elements
 * [start[j], start[j]+count[j]) of a and b, the same offsets in out):
 * dots: d[3j..3j+2] = <a,b>, <a,a>, <b,b> in float64, in a fixed order
 * (deterministic); host `d` receives them (the call waits).
 * combine: out = coef[2j]*a + coef[2j+1]*b, gs_cpu_adasum_combine's
 * arithmetic. */
gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b,
                              const int64_t *start, const int64_t *count, int64_t n,
                              double *d, void *stream);
gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count,
                                 const double *coef, int64_t n, void *stream);

/* ---- device bookkeeping (cuda_device.c) --------------------------------- */

/* Makes `device` current and returns gradsync's stream on it; *previous
 * receives the device that was current, for gs_cu_leave. */
gs_status_t gs_cu_enter(int device, void **stream, int *previous);
void gs_cu_leave(int previous);
/* Waits for the stream; turns a CUDA error into GS_ERR_CUDA naming `what`. */
gs_status_t gs_cu_sync(void *stream, const char *what);
/* Memory that stays with the caller until freed: device or pinned host. */
gs_status_t gs_cu_reserve(void **buf, size_t *have, size_t need, int pinned);
void gs_cu_release(void *buf, int pinned);
/* Asynchronous copy on the stream (any direction). */
gs_status_t gs_cu_copy(void *dst, const void *src, size_t bytes, void *stream);

#ifdef __cplusplus
}
#endif
#endif
