/* Host kernels of Adasum's local math: the three dot products in one pass
 * with float64 accumulation, and the scaled add, rounded once on store.
 * Plain loops the compiler vectorizes; no fast-math, so subnormals are kept
 * and the order of operations is fixed (results are reproducible). */
#include "gs_internal.h"
#include "half.h"

#define DOTS(load)                                         \
  do {                                                     \
    for (int64_t i = 0; i < n; i++) {                      \
      double x = (double)load(a, i), y = (double)load(b, i); \
      d += x * y;                                          \
      aa += x * x;                                         \
      bb += y * y;                                         \
    }                                                      \
  } while (0)

#define LOAD_F16(p, i) gs_half_to_float(((const uint16_t *)(p))[i])
#define LOAD_BF16(p, i) gs_bf16_to_float(((const uint16_t *)(p))[i])
#define LOAD_F32(p, i) (((const float *)(p))[i])
#define LOAD_F64(p, i) (((const double *)(p))[i])

void gs_cpu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, int64_t n,
                        double out[3]) {
  double d = 0, aa = 0, bb = 0;
  switch (dtype) {
    case GS_FLOAT16: DOTS(LOAD_F16); break;
    case GS_BFLOAT16: DOTS(LOAD_BF16); break;
    case GS_FLOAT32: DOTS(LOAD_F32); break;
    case GS_FLOAT64: DOTS(LOAD_F64); break;
    default: break;
  }
  out[0] += d;
  out[1] += aa;
  out[2] += bb;
}

void gs_cpu_adasum_combine(gs_dtype_t dtype, double ca, const void *a, double cb,
                           const void *b, void *out, int64_t n) {
  switch (dtype) {
    case GS_FLOAT16: {
      const float fa = (float)ca, fb = (float)cb;
      for (int64_t i = 0; i < n; i++)
        ((uint16_t *)out)[i] = gs_float_to_half(fa * LOAD_F16(a, i) + fb * LOAD_F16(b, i));
      break;
    }
    case GS_BFLOAT16: {
      const float fa = (float)ca, fb = (float)cb;
      for (int64_t i = 0; i < n; i++)
        ((uint16_t *)out)[i] = gs_float_to_bf16(fa * LOAD_BF16(a, i) + fb * LOAD_BF16(b, i));
      break;
    }
    case GS_FLOAT32: /* float64 coefficients: they can pass float32's range */
      for (int64_t i = 0; i < n; i++)
        ((float *)out)[i] = (float)(ca * (double)LOAD_F32(a, i) + cb * (double)LOAD_F32(b, i));
      break;
    case GS_FLOAT64:
      for (int64_t i = 0; i < n; i++)
        ((double *)out)[i] = ca * LOAD_F64(a, i) + cb * LOAD_F64(b, i);
      break;
    default: break;
  }
}
