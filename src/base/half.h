/* float16 and bfloat16 conversions, round to nearest even, subnormals kept.
 * Portable bit manipulation: results are identical to F16C's. */
#ifndef GRADSYNC_HALF_H
#define GRADSYNC_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The same conversions run in the CUDA kernels, so host and device results
 * agree bit for bit. */
#ifdef __CUDACC__
#define GS_HD __host__ __device__
#else
#define GS_HD
#endif

#ifdef __CUDA_ARCH__
static inline GS_HD float gs_bits_to_float(uint32_t u) { return __uint_as_float(u); }
static inline GS_HD uint32_t gs_float_to_bits(float f) { return __float_as_uint(f); }
#else
static inline GS_HD float gs_bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline GS_HD uint32_t gs_float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
#endif

static inline GS_HD float gs_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) /* inf, or nan: payload kept, quieted as IEEE conversion (F16C) does */
    return gs_bits_to_float(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in float */
    float f = (float)man * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  return gs_bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline GS_HD uint16_t gs_float_to_half(float f) {
  uint32_t u = gs_float_to_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) /* inf or nan (keep nan quiet and non-zero) */
    return sign | (a > 0x7f800000u ? (uint16_t)(0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u);
  if (a >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
    return sign | 0x7c00u;
  if (a < 0x38800000u) {
    /* result is subnormal or zero: scale so the float adder rounds (RNE) */
    float r = gs_bits_to_float(a) + 0.5f; /* 0.5 = 2^-1: ulp becomes 2^-24 */
    return sign | (uint16_t)(gs_float_to_bits(r) - 0x3f000000u);
  }
  uint32_t man_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + man_odd; /* rebias exponent (-112 << 23) and round */
  return sign | (uint16_t)(a >> 13);
}

static inline GS_HD float gs_bf16_to_float(uint16_t b) {
  return gs_bits_to_float((uint32_t)b << 16);
}

static inline GS_HD uint16_t gs_float_to_bf16(float f) {
  uint32_t u = gs_float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) /* nan: keep it quiet */
    return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* double -> float rounding to odd: truncate, then set the last bit when
 * anything was lost. A following round-to-nearest-even to a format with at
 * least two fewer significand bits (float16: 11, bfloat16: 8, against 24)
 * then rounds the double exactly once. */
static inline GS_HD float gs_double_to_float_odd(double d) {
  float f = (float)d;
  if ((double)f == d || d != d) return f;
  uint32_t u = gs_float_to_bits(f);
  /* f rounded away from zero (to a larger magnitude, inf included): step back
   * one ulp; a zero f never did, so the decrement cannot wrap. */
  if (fabs((double)f) > fabs(d)) u -= 1;
  return gs_bits_to_float(u | 1u);
}

static inline GS_HD uint16_t gs_double_to_half(double d) {
  return gs_float_to_half(gs_double_to_float_odd(d));
}
static inline GS_HD uint16_t gs_double_to_bf16(double d) {
  return gs_float_to_bf16(gs_double_to_float_odd(d));
}

#endif
