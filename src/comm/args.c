/* Argument checks shared by the collectives. Messages name the call, the
 * argument and the index, so the Python layer can pass them on unchanged. */
#include <stdint.h>
#include <stdlib.h>

#include "comm/gs_comm_internal.h"

typedef struct span {
  const char *lo, *hi;
  int64_t index;
} span_t;

static int by_start(const void *a, const void *b) {
  const span_t *x = a, *y = b;
  return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Outputs must not overlap each other, nor any input other than their own
 * in-place partner (out[i] == in[i] exactly). Sort the outputs, then look up
 * each input among them: O(n log n). */
static gs_status_t check_aliasing(const char *op_name, const char *in_name, const gs_tensor_t *in,
                                  const char *out_name, const gs_tensor_t *out, int64_t n,
                                  int allow_in_place) {
  span_t *outs = malloc((size_t)(n > 0 ? n : 1) * sizeof *outs);
  if (!outs) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", op_name);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i++) {
    size_t bytes = (size_t)out[i].count * gs_dtype_size(out[i].dtype);
    if (!bytes) continue;
    outs[m].lo = out[i].data;
    outs[m].hi = (const char *)out[i].data + bytes;
    outs[m].index = i;
    m++;
  }
  qsort(outs, (size_t)m, sizeof *outs, by_start);
  gs_status_t s = GS_SUCCESS;
  for (int64_t k = 1; k < m && s == GS_SUCCESS; k++)
    if (outs[k].lo < outs[k - 1].hi)
      s = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s[%lld] and %s[%lld] overlap", op_name, out_name,
                  (long long)outs[k - 1].index, out_name, (long long)outs[k].index);
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    size_t bytes = (size_t)in[i].count * gs_dtype_size(in[i].dtype);
    if (!bytes) continue; /* (an empty tensor's data may be NULL: no arithmetic on it) */
    const char *lo = in[i].data, *hi = lo + bytes;
    /* first output ending after lo: outputs are disjoint, so ends are sorted */
    int64_t a = 0, b = m;
    while (a < b) {
      int64_t mid = (a + b) / 2;
      if (outs[mid].hi <= lo) a = mid + 1;
      else b = mid;
    }
    for (int64_t k = a; k < m && outs[k].lo < hi; k++) {
      if (allow_in_place && outs[k].index == i && outs[k].lo == lo && outs[k].hi == hi)
        continue; /* in place */
      s = gs_fail(GS_ERR_INVALID_ARGUMENT,
                  "%s: %s[%lld] overlaps %s[%lld]; an output must be its own input exactly "
                  "(in place) or memory no input uses",
                  op_name, out_name, (long long)outs[k].index, in_name, (long long)i);
      break;
    }
  }
  free(outs);
  return s;
}

gs_status_t gs_check_tensors(const char *op_name, const char *name, const gs_tensor_t *t,
                             int64_t n) {
  if (n < 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: n (number of tensors) is negative: %lld", op_name,
                   (long long)n);
  if (n > 0 && !t) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", op_name, name);
  for (int64_t i = 0; i < n; i++) {
    if (!gs_dtype_valid(t[i].dtype))
      return gs_fail(GS_ERR_TYPE, "%s: %s[%lld] has unknown dtype %d", op_name, name, (long long)i,
                     (int)t[i].dtype);
    int64_t es = (int64_t)gs_dtype_size(t[i].dtype);
    if (t[i].count < 0 || t[i].count > INT64_MAX / 4 / es)
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s[%lld] has invalid element count %lld",
                     op_name, name, (long long)i, (long long)t[i].count);
    if (t[i].count > 0 && !t[i].data)
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s[%lld].data is NULL", op_name, name,
                     (long long)i);
    if (t[i].device.kind != GS_DEVICE_CPU && t[i].device.kind != GS_DEVICE_CUDA_HOST &&
        t[i].device.kind != GS_DEVICE_CUDA)
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s[%lld] has unknown device kind %d", op_name,
                     name, (long long)i, (int)t[i].device.kind);
    /* one call, one memory: host (plain or pinned) or one CUDA device */
    int cuda = t[i].device.kind == GS_DEVICE_CUDA, cuda0 = t[0].device.kind == GS_DEVICE_CUDA;
    if (cuda != cuda0 || (cuda && t[i].device.id != t[0].device.id))
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: %s[%lld] is in %s memory but %s[0] is in "
                     "%s memory; one call takes tensors on one device",
                     op_name, name, (long long)i, cuda ? "CUDA" : "host", name,
                     cuda0 ? "CUDA" : "host");
    if (cuda && !gs_cuda_built())
      return gs_fail(GS_ERR_UNSUPPORTED,
                     "%s: %s[%lld] is CUDA device memory; this build of gradsync has no GPU "
                     "support (build with nvcc present)",
                     op_name, name, (long long)i);
    /* a misaligned device access is a sticky fault that kills the process's
     * CUDA context: refuse it as the argument error it is */
    if (cuda && t[i].count > 0 && (uintptr_t)t[i].data % (uintptr_t)es != 0)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: %s[%lld] is CUDA memory at %p, which is not "
                     "aligned to its element size (%s, %lld bytes); pass an aligned view",
                     op_name, name, (long long)i, t[i].data, gs_dtype_name(t[i].dtype),
                     (long long)es);
  }
  return GS_SUCCESS;
}

gs_status_t gs_check_op(const char *op_name, gs_op_t op, const gs_tensor_t *t, int64_t n,
                        double prescale, double postscale, int allow_adasum) {
  if ((unsigned)op >= GS_NUM_OPS)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: op %d is not a gradsync op", op_name, (int)op);
  if (gs_op_is_adasum(op) && !allow_adasum)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: op %s exists only for allreduce", op_name,
                   gs_op_name(op));
  if (gs_op_is_adasum(op))
    for (int64_t i = 0; i < n; i++)
      if (!gs_dtype_is_float(t[i].dtype))
        return gs_fail(GS_ERR_TYPE, "%s: op %s needs floating dtypes, but tensor %lld is %s",
                       op_name, gs_op_name(op), (long long)i, gs_dtype_name(t[i].dtype));
  int scaled = op == GS_OP_AVERAGE || prescale != 1.0 || postscale != 1.0;
  if (!scaled) return GS_SUCCESS;
  for (int64_t i = 0; i < n; i++)
    if (!gs_dtype_is_float(t[i].dtype))
      return gs_fail(GS_ERR_TYPE, "%s: %s needs floating dtypes, but tensor %lld is %s", op_name,
                     op == GS_OP_AVERAGE ? "op average" : "prescale/postscale", (long long)i,
                     gs_dtype_name(t[i].dtype));
  return GS_SUCCESS;
}

gs_status_t gs_check_outputs(const char *op_name, const gs_tensor_t *in, const gs_tensor_t *out,
                             int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (out[i].dtype != in[i].dtype)
      return gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", op_name, (long long)i,
                     gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
    if (out[i].count != in[i].count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: out[%lld] has %lld elements, in[%lld] has %lld",
                     op_name, (long long)i, (long long)out[i].count, (long long)i,
                     (long long)in[i].count);
  }
  return check_aliasing(op_name, "in", in, "out", out, n, 1);
}

gs_status_t gs_check_pairs_disjoint(const char *op_name, const char *in_name, const gs_tensor_t *in,
                                    const char *out_name, const gs_tensor_t *out, int64_t n) {
  return check_aliasing(op_name, in_name, in, out_name, out, n, 1);
}

gs_status_t gs_check_disjoint(const char *op_name, const gs_tensor_t *in, const gs_tensor_t *out,
                              int64_t n) {
  return check_aliasing(op_name, "in", in, "out", out, n, 0);
}

gs_status_t gs_check_column(const char *fn, const char *name, const int64_t *counts, int64_t n,
                            int p, int64_t i, int64_t *sum, uint64_t *hash) {
  *sum = 0;
  for (int r = 0; r < p; r++) {
    int64_t v = counts[(size_t)r * n + i];
    if (v < 0 || v > INT64_MAX / 4 - *sum)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: %s[%lld] (tensor %lld, rank %d) is invalid: %lld", fn, name,
                     (long long)(r * n + i), (long long)i, r, (long long)v);
    *sum += v;
    if (hash) *hash = gs_hash_mix(*hash, (uint64_t)v);
  }
  return GS_SUCCESS;
}
