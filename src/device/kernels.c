/* The gradient kernels (gs_zero, gs_accumulate, gs_all_finite, gs_scale) on
 * CUDA memory: like a framework's own op, each runs on the calling thread's
 * work stream (gs_cuda_set_stream; the legacy default stream unless set)
 * and returns without waiting for the device, except gs_all_finite, which
 * must read its answer (it waits for its own kernel, polling). */
#include <stdlib.h>

#include "device/gs_cuda.h"

/* Runs `mode` over pairs (a[i], b[i]) (b may be NULL) on a's device. */
static gs_status_t device_elementwise(gs_cu_mode_t mode, const gs_tensor_t *a, const gs_tensor_t *b,
                                      int64_t n, double scale) {
  if (n == 0) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(a[0].device.id, &scope));
  gs_cu_run_t *runs = malloc((size_t)n * sizeof *runs);
  gs_status_t s = runs ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
    runs[i] = (gs_cu_run_t){a[i].data, b ? b[i].data : a[i].data, a[i].count, (int32_t)a[i].dtype,
                            (int32_t)(b ? b[i].dtype : a[i].dtype)};
  if (s == GS_SUCCESS) s = gs_cu_elementwise(mode, runs, n, scale, gs_cu_work_stream());
  free(runs);
  gs_cu_leave(&scope);
  return s;
}

gs_status_t gs_device_zero(const gs_tensor_t *t, int64_t n) {
  return device_elementwise(GS_CU_ZERO, t, NULL, n, 1.0);
}

gs_status_t gs_device_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                                 int overwrite) {
  for (int64_t i = 0; i < n; i++)
    if (grad[i].device.kind != GS_DEVICE_CUDA || grad[i].device.id != acc[0].device.id)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "gs_accumulate: grad[%lld] is not on acc's CUDA "
                     "device %d",
                     (long long)i, (int)acc[0].device.id);
  return device_elementwise(overwrite ? GS_CU_OVERWRITE : GS_CU_ACCUMULATE, acc, grad, n, 1.0);
}

gs_status_t gs_device_scale(const gs_tensor_t *t, int64_t n, double factor) {
  if (factor == 1.0) return GS_SUCCESS;
  return device_elementwise(GS_CU_COPY_SCALE, t, NULL, n, factor);
}

gs_status_t gs_device_all_finite(const gs_tensor_t *t, int64_t n, int *finite) {
  *finite = 1;
  if (n == 0) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(t[0].device.id, &scope));
  int bad = 0;
  gs_status_t s = gs_cu_nonfinite(t, n, &bad, gs_cu_work_stream());
  gs_cu_leave(&scope);
  *finite = !bad;
  return s;
}
