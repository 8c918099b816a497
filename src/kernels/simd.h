/* Private AVX2/F16C helpers shared by the host kernels: eight elements of
 * any floating dtype as float32 (exact widening), and back with round to
 * nearest even (NaN kept quiet, as half.h does). Compiled only into
 * functions marked GS_AVX2; callers dispatch at run time. */
#ifndef GRADSYNC_SIMD_H
#define GRADSYNC_SIMD_H

#include "kernels/gs_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GS_HAVE_X86 1
#define GS_AVX2 __attribute__((target("avx2,f16c")))

GS_AVX2 static inline __m256 gs_load8(gs_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case GS_FLOAT16:
      return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    case GS_BFLOAT16: {
      __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    default: return _mm256_loadu_ps((const float *)p + i);
  }
}

GS_AVX2 static inline __m128i gs_to_bf16x8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                   _mm256_set1_epi32(0x7f800000));
  __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, q, nan);
  __m256i packed = _mm256_packus_epi32(r, r); /* per 128-bit lane: 4 + 4 */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

GS_AVX2 static inline void gs_store8(gs_dtype_t dt, void *p, int64_t i, __m256 v) {
  switch (dt) {
    case GS_FLOAT16:
      _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                       _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
      break;
    case GS_BFLOAT16: _mm_storeu_si128((__m128i *)((uint16_t *)p + i), gs_to_bf16x8(v)); break;
    default: _mm256_storeu_ps((float *)p + i, v); break;
  }
}
#endif

#endif
