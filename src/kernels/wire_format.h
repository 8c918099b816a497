/* gradsync private, kernels/: the wire formats' element and layout arithmetic, one copy
 * for the host encoder (cpu_wire.c) and the CUDA kernels (cuda_pieces.cuh,
 * also run on the host by the emulated runtime), so a device encodes,
 * decodes and sums to the host's bits (the CUDA build passes --fmad=false,
 * and nothing here depends on the order of independent elements).
 *
 * The float8 formats carry one power-of-two scale per block of
 * GS_WIRE_BLOCK elements, as the OCP MX formats do: a shard of n elements
 * is ceil(n / 32) scale bytes (E8M0: 2^(byte - 127)), then n element bytes.
 * A block's scale is the smallest power of two that brings its largest
 * finite magnitude within the format's largest finite value, so no finite
 * element saturates (docs/decisions/wire.md). Elements convert as ml_dtypes'
 * float8_e4m3fn and float8_e5m2 do: round to nearest even, NaN stays NaN,
 * an infinity is NaN in e4m3 (which has none) and infinity in e5m2. */
#ifndef GRADSYNC_WIRE_FORMAT_H
#define GRADSYNC_WIRE_FORMAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "base/gs_base.h"
#include "base/half.h"

typedef struct gs_fp8_format {
  int mbits, bias, emax; /* emax: the largest finite value's exponent */
  double max;            /* the largest finite value */
  uint8_t nan, inf;      /* inf: 0 when the format has none (NaN then) */
  uint8_t max_code;      /* the largest finite value's bits, sign aside */
} gs_fp8_format_t;

/* The format of a float8 wire (by value: device code cannot read host
 * constants). */
#define GS_FP8_E4M3 {3, 7, 8, 448.0, 0x7f, 0, 0x7e}
#define GS_FP8_E5M2 {2, 15, 15, 57344.0, 0x7e, 0x7c, 0x7b}
static inline GS_HD gs_fp8_format_t gs_fp8_format(int wire) {
  gs_fp8_format_t e4m3 = GS_FP8_E4M3, e5m2 = GS_FP8_E5M2;
  return wire == GS_WIRE_FLOAT8_E4M3 ? e4m3 : e5m2;
}

static inline GS_HD int gs_wire_is_fp8(int wire) {
  return wire == GS_WIRE_FLOAT8_E4M3 || wire == GS_WIRE_FLOAT8_E5M2;
}

/* One float32 to float8's bits, round to nearest even; beyond the largest
 * finite value (after rounding) it is infinity, or NaN in a format without
 * one. A normal result rounds the significand by integer addition; a
 * subnormal one by adding a float whose ulp is the format's subnormal step,
 * which makes the FPU round (to nearest even, the default mode).
 * tests/c/test_wire_kernels.c checks it against an arithmetic reference. */
static inline GS_HD uint8_t gs_to_fp8_bits(const gs_fp8_format_t *f, float v) {
  uint32_t u = gs_float_to_bits(v);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | f->nan;
  if (u == 0x7f800000u) return sign | (f->inf ? f->inf : f->nan);
  int shift = 23 - f->mbits;
  uint32_t min_normal = (uint32_t)(128 - f->bias) << 23; /* 2^(1 - bias) */
  uint32_t code;
  if (u < min_normal) {
    uint32_t magic_bits = (uint32_t)(128 - f->bias - f->mbits + 23) << 23;
    float sum = gs_bits_to_float(u) + gs_bits_to_float(magic_bits);
    code = gs_float_to_bits(sum) - magic_bits; /* steps of 2^(1 - bias - mbits) */
  } else {
    u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1);
    code = (u >> shift) - ((uint32_t)(127 - f->bias) << f->mbits);
    if (code > f->max_code) return sign | (f->inf ? f->inf : f->nan);
  }
  return sign | (uint8_t)code;
}

/* float8's bits to float32 (exact). */
static inline GS_HD float gs_from_fp8(const gs_fp8_format_t *f, uint8_t b) {
  int exp = (b & 0x7f) >> f->mbits, man = b & ((1 << f->mbits) - 1);
  int top = (1 << (7 - f->mbits)) - 1;
  float v;
  if ((b & 0x7f) == f->nan || (f->inf && exp == top && man)) v = NAN;
  else if (f->inf && (b & 0x7f) == f->inf) v = INFINITY;
  else if (exp == 0) v = ldexpf((float)man, 1 - f->bias - f->mbits);
  else v = ldexpf((float)(man + (1 << f->mbits)), exp - f->bias - f->mbits);
  return (b & 0x80) ? -v : v;
}

/* 2^s as a float, exactly (s in [-149, 127]), and as a double (s in
 * [-1022, 1023]), from the bits: ldexpf is a library call, and the
 * encoder needs a few per 32-element block. */
static inline GS_HD float gs_pow2f(int s) {
  return gs_bits_to_float(s >= -126 ? (uint32_t)(s + 127) << 23 : 1u << (s + 149));
}
static inline GS_HD double gs_pow2(int s) {
  uint64_t u = (uint64_t)(s + 1023) << 52;
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

/* What a block's elements contribute to its scale: the finite magnitudes
 * (NaN and infinity 0). The scale is the largest over the block. */
static inline GS_HD float gs_wire_magnitude(float x) {
  float a = fabsf(x);
  return a == a && a != INFINITY ? a : 0.0f;
}

/* The block's scale exponent from its largest finite magnitude m: the
 * smallest s with m * 2^-s <= max, within E8M0's [-127, 127]; 0 for a
 * block of zeros and non-finite values. */
static inline GS_HD int gs_wire_scale_exponent(const gs_fp8_format_t *f, float m) {
  if (m == 0) return 0;
  uint32_t e = gs_float_to_bits(m) >> 23; /* m > 0: no sign bit */
  int s = (e ? (int)e - 127 : ilogbf(m)) - f->emax;
  if ((double)m * gs_pow2(-s) > f->max) s++; /* exact: a power of two */
  return s < -127 ? -127 : s;
}

/* What an encoding lost: x minus its decoded value q, 0 where q is not
 * finite (error feedback adds it to a residual). */
static inline GS_HD float gs_wire_lost(float x, float q) { return isfinite(q) ? x - q : 0.0f; }

/* ---- shards: which rank owns which elements of a segment ----------------- */

/* A segment of n elements over p ranks: nb blocks, balanced, the first
 * `extra` shards one block longer (the divisions done once, for kernels
 * that place many blocks). */
typedef struct gs_wire_layout {
  int64_t n, nb, lo, extra, big; /* big: blocks in the longer shards */
  int p, wire;
} gs_wire_layout_t;

static inline GS_HD gs_wire_layout_t gs_wire_layout(int wire, int64_t n, int p) {
  gs_wire_layout_t L;
  L.n = n;
  L.p = p;
  L.wire = wire;
  L.nb = (n + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK;
  L.lo = L.nb / p;
  L.extra = L.nb % p;
  L.big = L.extra * (L.lo + 1);
  return L;
}

/* Shard q's first element and count. */
static inline GS_HD void gs_wire_layout_shard(const gs_wire_layout_t *L, int q, int64_t *first,
                                              int64_t *count) {
  int64_t b0 = q * L->lo + (q < L->extra ? q : L->extra), nbq = L->lo + (q < L->extra);
  int64_t end = (b0 + nbq) * GS_WIRE_BLOCK;
  *first = b0 * GS_WIRE_BLOCK < L->n ? b0 * GS_WIRE_BLOCK : L->n;
  *count = (end < L->n ? end : L->n) - *first;
}

/* Shard q of n elements over p ranks. */
static inline GS_HD void gs_wire_shard(int64_t n, int p, int q, int64_t *first, int64_t *count) {
  gs_wire_layout_t L = gs_wire_layout(GS_WIRE_BFLOAT16, n, p);
  gs_wire_layout_shard(&L, q, first, count);
}

/* Bytes of a shard of `count` elements (gs_wire_bytes). */
static inline GS_HD int64_t gs_wire_shard_bytes(int wire, int64_t count) {
  if (gs_wire_is_fp8(wire)) return count + (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK;
  return 2 * count;
}

/* Where block b lies among the shards packed back to back: its shard, the
 * shard's first element and count, where the shard's bytes start (`at`),
 * and the block's scale byte and first element within the packing (float8;
 * for 16-bit wires elem is the element's offset in 2-byte units, scale
 * unused). */
typedef struct gs_wire_place {
  int q;
  int64_t first, count, at, scale, elem;
} gs_wire_place_t;

static inline GS_HD gs_wire_place_t gs_wire_place(const gs_wire_layout_t *L, int64_t b) {
  gs_wire_place_t w;
  w.q = (int)(b < L->big ? b / (L->lo + 1) : L->extra + (L->lo ? (b - L->big) / L->lo : 0));
  gs_wire_layout_shard(L, w.q, &w.first, &w.count);
  int64_t b0 = w.first / GS_WIRE_BLOCK, local = b - b0;
  if (gs_wire_is_fp8(L->wire)) {
    w.at = w.first + b0; /* every earlier shard: whole blocks, 33 bytes each */
    w.scale = w.at + local;
    w.elem = w.at + (w.count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK + local * GS_WIRE_BLOCK;
  } else {
    w.at = 2 * w.first;
    w.scale = 0;
    w.elem = b * GS_WIRE_BLOCK;
  }
  return w;
}

#endif
