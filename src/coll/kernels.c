/* The gradient kernels' public entry points (gs_zero, gs_accumulate,
 * gs_all_finite, gs_scale): argument checks, then the host kernels
 * (kernels/cpu.c) or, for CUDA memory, the device ones (device/kernels.c). */
#include "coll/gs_collective.h"

static int on_device(const gs_tensor_t *t, int64_t n) {
  return n > 0 && t[0].device.kind == GS_DEVICE_CUDA;
}

static gs_status_t check_floats(const char *fn, const char *name, const gs_tensor_t *t, int64_t n) {
  GS_CHECK(gs_check_tensors(fn, name, t, n));
  for (int64_t i = 0; i < n; i++)
    if (!gs_dtype_is_float(t[i].dtype))
      return gs_fail(GS_ERR_TYPE,
                     "%s: %s[%lld] is %s; this kernel takes float16, bfloat16, "
                     "float32 or float64",
                     fn, name, (long long)i, gs_dtype_name(t[i].dtype));
  return GS_SUCCESS;
}

gs_status_t gs_zero(const gs_tensor_t *t, int64_t n) {
  gs_clear_error();
  GS_CHECK(gs_check_tensors("gs_zero", "tensors", t, n));
  if (on_device(t, n)) return gs_device_zero(t, n);
  gs_cpu_zero(t, n);
  return GS_SUCCESS;
}

gs_status_t gs_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                          int overwrite) {
  static const char fn[] = "gs_accumulate";
  gs_clear_error();
  GS_CHECK(check_floats(fn, "acc", acc, n));
  GS_CHECK(check_floats(fn, "grad", grad, n));
  for (int64_t i = 0; i < n; i++)
    if (acc[i].count != grad[i].count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: acc[%lld] has %lld elements but grad[%lld] "
                     "has %lld",
                     fn, (long long)i, (long long)acc[i].count, (long long)i,
                     (long long)grad[i].count);
  /* acc[i] is written while grad[j] is read, by other threads (or blocks) */
  GS_CHECK(gs_check_pairs_disjoint(fn, "grad", grad, "acc", acc, n));
  if (on_device(acc, n) != on_device(grad, n))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: acc is in %s memory but grad is in %s memory", fn,
                   on_device(acc, n) ? "CUDA" : "host", on_device(grad, n) ? "CUDA" : "host");
  if (on_device(acc, n)) return gs_device_accumulate(acc, grad, n, overwrite);
  return gs_cpu_accumulate(acc, grad, n, overwrite);
}

gs_status_t gs_all_finite(const gs_tensor_t *t, int64_t n, int *finite) {
  gs_clear_error();
  GS_CHECK(gs_check_tensors("gs_all_finite", "tensors", t, n));
  if (!finite) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_all_finite: finite is NULL");
  if (on_device(t, n)) return gs_device_all_finite(t, n, finite);
  int bad = 0;
  GS_CHECK(gs_cpu_nonfinite(t, n, &bad));
  *finite = !bad;
  return GS_SUCCESS;
}

gs_status_t gs_scale(const gs_tensor_t *t, int64_t n, double factor) {
  gs_clear_error();
  GS_CHECK(check_floats("gs_scale", "tensors", t, n));
  if (on_device(t, n)) return gs_device_scale(t, n, factor);
  return gs_cpu_scale(t, n, factor);
}
