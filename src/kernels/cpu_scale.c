/* Host scaling kernel used when packing (prescale) and unpacking (postscale,
 * average): widen to float32 (float64 for float64), multiply, round once. */
#include <string.h>

#include "kernels/gs_kernels.h"
#include "base/half.h"

#define SCALE_HALF(to_f, from_f)                                       \
  do {                                                                 \
    const uint16_t *s = src;                                           \
    uint16_t *d = dst;                                                 \
    float f = (float)scale;                                            \
    for (int64_t i = 0; i < count; i++) d[i] = from_f(to_f(s[i]) * f); \
  } while (0)

void gs_cpu_scale_copy(gs_dtype_t dtype, const void *src, void *dst, int64_t count, double scale) {
  if (count <= 0) return;
  if (scale == 1.0) {
    if (src != dst) memmove(dst, src, (size_t)count * gs_dtype_size(dtype));
    return;
  }
  switch (dtype) {
    case GS_FLOAT16: SCALE_HALF(gs_half_to_float, gs_float_to_half); break;
    case GS_BFLOAT16: SCALE_HALF(gs_bf16_to_float, gs_float_to_bf16); break;
    case GS_FLOAT32: {
      const float *s = src;
      float *d = dst;
      float f = (float)scale;
      for (int64_t i = 0; i < count; i++) d[i] = s[i] * f;
      break;
    }
    case GS_FLOAT64: {
      const double *s = src;
      double *d = dst;
      for (int64_t i = 0; i < count; i++) d[i] = s[i] * scale;
      break;
    }
    default: /* integers never get here: gs_check_op rejects their scales */
      if (src != dst) memmove(dst, src, (size_t)count * gs_dtype_size(dtype));
      break;
  }
}
