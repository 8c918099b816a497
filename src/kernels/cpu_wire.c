/* Low-precision wire formats (gs_allreduce_wire): encoding float32 values
 * for the wire and decoding them back, on the host. The element arithmetic
 * and the layout are wire_format.h's, shared with the CUDA kernels. */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "kernels/gs_kernels.h"
#include "kernels/simd.h"
#include "kernels/wire_format.h"

typedef gs_fp8_format_t fp8_format_t;

static const fp8_format_t e4m3 = GS_FP8_E4M3, e5m2 = GS_FP8_E5M2;

static const fp8_format_t *fp8(gs_wire_t wire) {
  return wire == GS_WIRE_FLOAT8_E4M3 ? &e4m3 : wire == GS_WIRE_FLOAT8_E5M2 ? &e5m2 : NULL;
}

int64_t gs_wire_bytes(gs_wire_t wire, int64_t count) { return gs_wire_shard_bytes(wire, count); }

/* One value to float8, round to nearest even; beyond the largest finite
 * value (after rounding) it is infinity, or NaN in a format without one.
 * The arithmetic reference for to_fp8_bits (tests/c/test_wire_kernels.c
 * includes this file); the library itself encodes with to_fp8_bits. */
__attribute__((unused)) static uint8_t to_fp8(const fp8_format_t *f, double v) {
  uint8_t sign = signbit(v) ? 0x80 : 0;
  double a = fabs(v);
  if (a != a) return sign | f->nan;
  int emin = 1 - f->bias, e;
  frexp(a, &e);
  e -= 1;                           /* a in [2^e, 2^(e+1)) */
  if (e < emin) e = emin;           /* subnormal: the smallest normal's step */
  double q = nearbyint(ldexp(a, f->mbits - e)); /* significand in ulps (RNE) */
  if (q >= ldexp(1.0, f->mbits + 1)) { /* rounded up into the next binade */
    q /= 2;
    e += 1;
  }
  if (a == INFINITY || ldexp(q, e - f->mbits) > f->max) return sign | (f->inf ? f->inf : f->nan);
  if (q < ldexp(1.0, f->mbits)) return sign | (uint8_t)q; /* subnormal (or zero) */
  return sign | (uint8_t)(((e + f->bias) << f->mbits) | ((int)q - (1 << f->mbits)));
}

/* The encoder's conversion, under the name test_wire_kernels.c checks. */
static inline uint8_t to_fp8_bits(const fp8_format_t *f, float v) { return gs_to_fp8_bits(f, v); }
static float from_fp8(const fp8_format_t *f, uint8_t b) { return gs_from_fp8(f, b); }

/* Decoding by table: 256 values per format, made once. */
static float e4m3_table[256], e5m2_table[256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;
static void make_tables(void) {
  for (int b = 0; b < 256; b++) {
    e4m3_table[b] = from_fp8(&e4m3, (uint8_t)b);
    e5m2_table[b] = from_fp8(&e5m2, (uint8_t)b);
  }
}
static const float *fp8_table(gs_wire_t wire) {
  pthread_once(&tables_once, make_tables);
  return wire == GS_WIRE_FLOAT8_E4M3 ? e4m3_table : e5m2_table;
}

/* The block's scale exponent (gs_wire_scale_exponent of its largest
 * finite magnitude). */
static int block_scale(const fp8_format_t *f, const float *x, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; i++) { /* a magnitude is never NaN: a plain max (fmaxf is a call) */
    float a = gs_wire_magnitude(x[i]);
    m = a > m ? a : m;
  }
  return gs_wire_scale_exponent(f, m);
}

#if GS_HAVE_X86
/* gs_to_fp8_bits on eight lanes (codes in 32-bit lanes): the same integer
 * and float32 steps, every branch computed and the lane's one blended in. */
GS_AVX2 static __m256i fp8_codes8(const fp8_format_t *f, __m256 v) {
  const __m128i shift = _mm_cvtsi32_si128(23 - f->mbits);
  __m256i u = _mm256_castps_si256(v);
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  u = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i magic = _mm256_set1_epi32((128 - f->bias - f->mbits + 23) << 23);
  __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(magic));
  __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
  __m256i odd = _mm256_and_si256(_mm256_srl_epi32(u, shift), _mm256_set1_epi32(1));
  __m256i half = _mm256_set1_epi32((1 << (22 - f->mbits)) - 1);
  __m256i r = _mm256_srl_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), odd), shift);
  r = _mm256_sub_epi32(r, _mm256_set1_epi32((127 - f->bias) << f->mbits));
  __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - f->bias) << 23), u);
  __m256i code = _mm256_blendv_epi8(r, sub, is_sub);
  /* too large (infinity included): the format's infinity, else its NaN */
  __m256i big =
      _mm256_andnot_si256(is_sub, _mm256_cmpgt_epi32(code, _mm256_set1_epi32(f->max_code)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(f->inf ? f->inf : f->nan), big);
  __m256i nan = _mm256_cmpgt_epi32(u, _mm256_set1_epi32(0x7f800000));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(f->nan), nan);
  return _mm256_or_si256(code, sign);
}

/* One whole block (GS_WIRE_BLOCK = 32 elements) as encode_fp8's loop does it. */
GS_AVX2 static void encode_fp8_block(const fp8_format_t *f, const float *table, const float *x,
                                     uint8_t *scale, uint8_t *elems, float *lost) {
  __m256 m = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < GS_WIRE_BLOCK; i += 8) { /* gs_wire_magnitude: finite |x|, else 0 */
    __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs);
    m = _mm256_max_ps(m, _mm256_and_ps(a, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  int s = gs_wire_scale_exponent(f, _mm_cvtss_f32(h));
  *scale = (uint8_t)(s + 127);
  __m256 up = _mm256_set1_ps(gs_pow2f(s)), down = _mm256_set1_ps(gs_pow2f(-s));
  __m256i c[4];
  for (int k = 0; k < 4; k++) {
    __m256 xv = _mm256_loadu_ps(x + 8 * k);
    c[k] = fp8_codes8(f, _mm256_mul_ps(xv, down));
    if (!lost) continue;
    __m256 q = _mm256_mul_ps(_mm256_i32gather_ps(table, c[k], 4), up);
    __m256 finite = _mm256_cmp_ps(_mm256_and_ps(q, abs), inf, _CMP_LT_OQ);
    __m256 d = _mm256_and_ps(_mm256_sub_ps(xv, q), finite); /* gs_wire_lost */
    _mm256_storeu_ps(lost + 8 * k, _mm256_add_ps(_mm256_loadu_ps(lost + 8 * k), d));
  }
  /* 4 x 8 codes to 32 bytes: the packs interleave 128-bit lanes, the
   * permutation puts each vector's eight back together */
  __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i *)elems, b);
}
#endif

/* Float8 blocks of x: scale bytes to `scales`, elements to `elems` (a
 * shard's two parts, or a chunk of them). `lost` as for gs_wire_encode. */
static void encode_fp8(gs_wire_t wire, const float *x, int64_t count, uint8_t *scales,
                       uint8_t *elems, float *lost) {
  const fp8_format_t *f = fp8(wire);
  const float *table = fp8_table(wire);
  int64_t nb = (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK, b = 0;
#if GS_HAVE_X86
  if (gs_simd_avx2())
    for (; b < count / GS_WIRE_BLOCK; b++) {
      int64_t lo = b * GS_WIRE_BLOCK;
      encode_fp8_block(f, table, x + lo, scales + b, elems + lo, lost ? lost + lo : NULL);
    }
#endif
  for (; b < nb; b++) {
    int64_t lo = b * GS_WIRE_BLOCK, n = count - lo < GS_WIRE_BLOCK ? count - lo : GS_WIRE_BLOCK;
    int s = block_scale(f, x + lo, n);
    scales[b] = (uint8_t)(s + 127);
    float up = gs_pow2f(s);
    /* x * 2^-s: exact, unless it falls below float32's normals, where it is
     * far below the format's smallest subnormal and encodes as zero anyway */
    float down = gs_pow2f(-s);
    for (int64_t i = lo; i < lo + n; i++) {
      elems[i] = to_fp8_bits(f, x[i] * down);
      if (lost) lost[i] += gs_wire_lost(x[i], table[elems[i]] * up);
    }
  }
}

#if GS_HAVE_X86
/* encode_half's loop eight elements at a time (simd.h's conversions round
 * as half.h's do); returns how many it did. */
GS_AVX2 static int64_t encode_half8(int bf, const float *src, int64_t count, uint16_t *h,
                                    float *lost) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 x = _mm256_loadu_ps(src + i);
    __m128i q = bf ? gs_to_bf16x8(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)(h + i), q);
    if (!lost) continue;
    __m256 back = bf ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(q), 16))
                     : _mm256_cvtph_ps(q);
    __m256 finite = _mm256_cmp_ps(_mm256_and_ps(back, abs), inf, _CMP_LT_OQ);
    __m256 d = _mm256_and_ps(_mm256_sub_ps(x, back), finite); /* gs_wire_lost */
    _mm256_storeu_ps(lost + i, _mm256_add_ps(_mm256_loadu_ps(lost + i), d));
  }
  return i;
}
#endif

static void encode_half(gs_wire_t wire, const float *src, int64_t count, uint16_t *h, float *lost) {
  int bf = wire == GS_WIRE_BFLOAT16;
  int64_t i = 0;
#if GS_HAVE_X86
  if (gs_simd_avx2()) i = encode_half8(bf, src, count, h, lost);
#endif
  for (; i < count; i++) {
    h[i] = bf ? gs_float_to_bf16(src[i]) : gs_float_to_half(src[i]);
    if (lost) lost[i] += gs_wire_lost(src[i], bf ? gs_bf16_to_float(h[i]) : gs_half_to_float(h[i]));
  }
}

void gs_wire_encode(gs_wire_t wire, const float *src, int64_t count, void *dst, float *lost) {
  if (fp8(wire)) {
    uint8_t *scales = dst;
    encode_fp8(wire, src, count, scales, scales + (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK,
               lost);
  } else {
    encode_half(wire, src, count, dst, lost);
  }
}

/* Decodes `count` elements (float8: `scales` per block from the first);
 * add: acc[i] += decoded (float32), else dst[i] = decoded. */
#if GS_HAVE_X86
/* One whole block of codes decoded (add: added to dst) as decode_at's loop
 * does it: the table's values (a gather) times the block's scale. */
GS_AVX2 static void decode_fp8_block(const float *table, const uint8_t *e, float up, float *dst,
                                     int add) {
  __m256 u = _mm256_set1_ps(up);
  for (int i = 0; i < GS_WIRE_BLOCK; i += 8) {
    __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + i)));
    __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(table, code, 4), u);
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    _mm256_storeu_ps(dst + i, v);
  }
}
#endif

static void decode_at(gs_wire_t wire, const uint8_t *scales, const void *elems, int64_t count,
                      float *dst, int add) {
  if (fp8(wire)) {
    const float *table = fp8_table(wire);
    const uint8_t *e = elems;
    int64_t lo = 0;
#if GS_HAVE_X86
    if (gs_simd_avx2())
      for (; lo + GS_WIRE_BLOCK <= count; lo += GS_WIRE_BLOCK)
        decode_fp8_block(table, e + lo, gs_pow2f((int)scales[lo / GS_WIRE_BLOCK] - 127), dst + lo,
                         add);
#endif
    for (; lo < count; lo += GS_WIRE_BLOCK) {
      int64_t hi = count - lo < GS_WIRE_BLOCK ? count : lo + GS_WIRE_BLOCK;
      float up = gs_pow2f((int)scales[lo / GS_WIRE_BLOCK] - 127);
      if (add)
        for (int64_t i = lo; i < hi; i++) dst[i] += table[e[i]] * up;
      else
        for (int64_t i = lo; i < hi; i++) dst[i] = table[e[i]] * up;
    }
    return;
  }
  const uint16_t *h = elems;
  int bf = wire == GS_WIRE_BFLOAT16;
  for (int64_t i = 0; i < count; i++) {
    float v = bf ? gs_bf16_to_float(h[i]) : gs_half_to_float(h[i]);
    dst[i] = add ? dst[i] + v : v;
  }
}

static void decode(gs_wire_t wire, const void *src, int64_t count, float *dst, int add) {
  int64_t nb = fp8(wire) ? (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK : 0;
  decode_at(wire, src, (const uint8_t *)src + nb, count, dst, add);
}

void gs_wire_decode(gs_wire_t wire, const void *src, int64_t count, float *dst) {
  decode(wire, src, count, dst, 0);
}

void gs_wire_decode_add(gs_wire_t wire, const void *src, int64_t count, float *acc) {
  decode(wire, src, count, acc, 1);
}

/* A chunk of the owner's step: elements [lo, lo + n) of every contribution
 * decoded and summed in rank order into acc, times post, encoded into the
 * shard at dst. */
static void reduce_chunk(gs_wire_t wire, const uint8_t *src, size_t stride, int p, int64_t count,
                         float post, uint8_t *dst, float *out_lost, int64_t lo, int64_t n,
                         float *acc) {
  int f8 = fp8(wire) != NULL;
  int64_t nb = f8 ? (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK : 0;
  size_t es = f8 ? 1 : 2;
  for (int q = 0; q < p; q++) {
    const uint8_t *c = src + (size_t)q * stride;
    decode_at(wire, c + lo / GS_WIRE_BLOCK, c + nb + (size_t)lo * es, n, acc, q > 0);
  }
  if (post != 1.0f)
    for (int64_t i = 0; i < n; i++) acc[i] *= post;
  float *lost = out_lost ? out_lost + lo : NULL;
  if (f8) encode_fp8(wire, acc, n, dst + lo / GS_WIRE_BLOCK, dst + nb + lo, lost);
  else encode_half(wire, acc, n, (uint16_t *)dst + lo, lost);
}

void gs_wire_reduce(gs_wire_t wire, const void *src, size_t stride, int p, int64_t count,
                    float post, void *dst, float *out_lost) {
  enum { CHUNK = 32 * GS_WIRE_BLOCK }; /* whole blocks: the same scales as one pass */
  float acc[CHUNK];
  for (int64_t lo = 0; lo < count; lo += CHUNK)
    reduce_chunk(wire, src, stride, p, count, post, dst, out_lost, lo,
                 count - lo < CHUNK ? count - lo : CHUNK, acc);
}

void gs_wire_widen(gs_dtype_t dtype, const void *src, float *dst, int64_t count, double scale) {
  if (dtype == GS_FLOAT32 && scale == 1.0) {
    if ((const void *)dst != src) memmove(dst, src, (size_t)count * sizeof(float));
    return;
  }
  float k = (float)scale;
  for (int64_t i = 0; i < count; i++) {
    float v = dtype == GS_FLOAT16    ? gs_half_to_float(((const uint16_t *)src)[i])
              : dtype == GS_BFLOAT16 ? gs_bf16_to_float(((const uint16_t *)src)[i])
                                     : ((const float *)src)[i];
    dst[i] = scale == 1.0 ? v : v * k;
  }
}

void gs_wire_narrow(gs_dtype_t dtype, const float *src, void *dst, int64_t count) {
  if (dtype == GS_FLOAT32) {
    if (dst != (const void *)src) memmove(dst, src, (size_t)count * sizeof(float));
    return;
  }
  uint16_t *h = dst;
  for (int64_t i = 0; i < count; i++)
    h[i] = dtype == GS_FLOAT16 ? gs_float_to_half(src[i]) : gs_float_to_bf16(src[i]);
}
