/* Host kernels of Adasum's local math: the three dot products in one pass
 * with float64 accumulation, and the scaled add, rounded once on store.
 *
 * One summation order for every SIMD level: element i accumulates into lane
 * i % 8 and the lanes are summed pairwise at the end; no FMA anywhere
 * (-ffp-contract=off). The AVX2/F16C path therefore gives the same bits as
 * the portable one, and results do not depend on the machine. Subnormals are
 * kept (no flush-to-zero, no fast-math). */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "kernels/gs_kernels.h"
#include "base/half.h"

#include "kernels/simd.h"

#define LANES 8

static double lanes_sum(const double l[LANES]) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static inline float load_elem(gs_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case GS_FLOAT16: return gs_half_to_float(((const uint16_t *)p)[i]);
    case GS_BFLOAT16: return gs_bf16_to_float(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

/* ---- portable ------------------------------------------------------------ */

/* Elements [from, n) into their lanes (element i into lane i % LANES). */
static void dots_into_lanes(gs_dtype_t dt, const void *a, const void *b, int64_t from, int64_t n,
                            double d[LANES], double aa[LANES], double bb[LANES]) {
  for (int64_t i = from; i < n; i++) {
    double x = dt == GS_FLOAT64 ? ((const double *)a)[i] : (double)load_elem(dt, a, i);
    double y = dt == GS_FLOAT64 ? ((const double *)b)[i] : (double)load_elem(dt, b, i);
    int l = (int)(i % LANES);
    d[l] += x * y;
    aa[l] += x * x;
    bb[l] += y * y;
  }
}

static void lanes_into(double out[3], const double d[LANES], const double aa[LANES],
                       const double bb[LANES]) {
  out[0] += lanes_sum(d);
  out[1] += lanes_sum(aa);
  out[2] += lanes_sum(bb);
}

static void portable_dots(gs_dtype_t dt, const void *a, const void *b, int64_t n, double out[3]) {
  double d[LANES] = {0}, aa[LANES] = {0}, bb[LANES] = {0};
  dots_into_lanes(dt, a, b, 0, n, d, aa, bb);
  lanes_into(out, d, aa, bb);
}

/* float16/bfloat16 combine in float32 as docs/DESIGN.md says, unless a coefficient
 * is beyond float32's range (bfloat16 spans float32's exponents, so per-rank
 * scales from tiny to sqrt(max) give coefficients near 1e57): then in float64,
 * still rounded once. */
static int coefficients_fit_float(double ca, double cb) {
  return fabs(ca) <= 3.4028234663852886e38 && fabs(cb) <= 3.4028234663852886e38;
}

static void wide_combine16(gs_dtype_t dt, double ca, const void *a, double cb, const void *b,
                           void *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = ca * (double)load_elem(dt, a, i) + cb * (double)load_elem(dt, b, i);
    ((uint16_t *)out)[i] = dt == GS_FLOAT16 ? gs_double_to_half(v) : gs_double_to_bf16(v);
  }
}

static void portable_combine(gs_dtype_t dt, double ca, const void *a, double cb, const void *b,
                             void *out, int64_t n) {
  if ((dt == GS_FLOAT16 || dt == GS_BFLOAT16) && !coefficients_fit_float(ca, cb)) {
    wide_combine16(dt, ca, a, cb, b, out, n);
    return;
  }
  const float fa = (float)ca, fb = (float)cb;
  for (int64_t i = 0; i < n; i++) {
    switch (dt) {
      case GS_FLOAT16:
        ((uint16_t *)out)[i] =
            gs_float_to_half(fa * load_elem(dt, a, i) + fb * load_elem(dt, b, i));
        break;
      case GS_BFLOAT16:
        ((uint16_t *)out)[i] =
            gs_float_to_bf16(fa * load_elem(dt, a, i) + fb * load_elem(dt, b, i));
        break;
      case GS_FLOAT32: /* float64 coefficients: they can pass float32's range */
        ((float *)out)[i] =
            (float)(ca * (double)((const float *)a)[i] + cb * (double)((const float *)b)[i]);
        break;
      case GS_FLOAT64:
        ((double *)out)[i] = ca * ((const double *)a)[i] + cb * ((const double *)b)[i];
        break;
      default: return;
    }
  }
}

/* ---- AVX2 + F16C ------------------------------------------------------------ */
#ifdef GS_HAVE_X86
#define AVX2 GS_AVX2
#define load8 gs_load8

AVX2 static void avx2_dots(gs_dtype_t dt, const void *a, const void *b, int64_t n, double out[3]) {
  __m256d d0 = _mm256_setzero_pd(), d1 = d0, a0 = d0, a1 = d0, b0 = d0, b1 = d0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    __m256d xl, xh, yl, yh; /* lanes 0-3 and 4-7 */
    if (dt == GS_FLOAT64) {
      xl = _mm256_loadu_pd((const double *)a + i);
      xh = _mm256_loadu_pd((const double *)a + i + 4);
      yl = _mm256_loadu_pd((const double *)b + i);
      yh = _mm256_loadu_pd((const double *)b + i + 4);
    } else {
      __m256 x = load8(dt, a, i), y = load8(dt, b, i);
      xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      yl = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
      yh = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
    }
    d0 = _mm256_add_pd(d0, _mm256_mul_pd(xl, yl));
    d1 = _mm256_add_pd(d1, _mm256_mul_pd(xh, yh));
    a0 = _mm256_add_pd(a0, _mm256_mul_pd(xl, xl));
    a1 = _mm256_add_pd(a1, _mm256_mul_pd(xh, xh));
    b0 = _mm256_add_pd(b0, _mm256_mul_pd(yl, yl));
    b1 = _mm256_add_pd(b1, _mm256_mul_pd(yh, yh));
  }
  double d[LANES], aa[LANES], bb[LANES];
  _mm256_storeu_pd(d, d0);
  _mm256_storeu_pd(d + 4, d1);
  _mm256_storeu_pd(aa, a0);
  _mm256_storeu_pd(aa + 4, a1);
  _mm256_storeu_pd(bb, b0);
  _mm256_storeu_pd(bb + 4, b1);
  dots_into_lanes(dt, a, b, i, n, d, aa, bb); /* the tail: i is a multiple of LANES */
  lanes_into(out, d, aa, bb);
}

AVX2 static void avx2_combine(gs_dtype_t dt, double ca, const void *a, double cb, const void *b,
                              void *out, int64_t n) {
  int64_t i = 0;
  if ((dt == GS_FLOAT16 || dt == GS_BFLOAT16) && !coefficients_fit_float(ca, cb)) {
    wide_combine16(dt, ca, a, cb, b, out, n);
    return;
  }
  if (dt == GS_FLOAT16 || dt == GS_BFLOAT16) {
    const __m256 fa = _mm256_set1_ps((float)ca), fb = _mm256_set1_ps((float)cb);
    for (; i + LANES <= n; i += LANES) {
      __m256 v =
          _mm256_add_ps(_mm256_mul_ps(fa, load8(dt, a, i)), _mm256_mul_ps(fb, load8(dt, b, i)));
      __m128i h =
          dt == GS_FLOAT16 ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT) : gs_to_bf16x8(v);
      _mm_storeu_si128((__m128i *)((uint16_t *)out + i), h);
    }
  } else if (dt == GS_FLOAT32) {
    const __m256d da = _mm256_set1_pd(ca), db = _mm256_set1_pd(cb);
    for (; i + 4 <= n; i += 4) {
      __m256d x = _mm256_cvtps_pd(_mm_loadu_ps((const float *)a + i));
      __m256d y = _mm256_cvtps_pd(_mm_loadu_ps((const float *)b + i));
      _mm_storeu_ps((float *)out + i,
                    _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(da, x), _mm256_mul_pd(db, y))));
    }
  } else if (dt == GS_FLOAT64) {
    const __m256d da = _mm256_set1_pd(ca), db = _mm256_set1_pd(cb);
    for (; i + 4 <= n; i += 4) {
      __m256d x = _mm256_loadu_pd((const double *)a + i),
              y = _mm256_loadu_pd((const double *)b + i);
      _mm256_storeu_pd((double *)out + i,
                       _mm256_add_pd(_mm256_mul_pd(da, x), _mm256_mul_pd(db, y)));
    }
  }
  size_t es = gs_dtype_size(dt);
  if (i < n)
    portable_combine(dt, ca, (const char *)a + (size_t)i * es, cb, (const char *)b + (size_t)i * es,
                     (char *)out + (size_t)i * es, n - i);
}
#endif

/* ---- dispatch ---------------------------------------------------------------- */

typedef void (*dots_fn)(gs_dtype_t, const void *, const void *, int64_t, double *);
typedef void (*combine_fn)(gs_dtype_t, double, const void *, double, const void *, void *, int64_t);
static dots_fn dots_impl = portable_dots;
static combine_fn combine_impl = portable_combine;
static pthread_once_t dispatch_once = PTHREAD_ONCE_INIT;

static void choose(void) {
#ifdef GS_HAVE_X86
  if (gs_simd_avx2()) {
    dots_impl = avx2_dots;
    combine_impl = avx2_combine;
  }
#endif
}

void gs_cpu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, int64_t n, double out[3]) {
  pthread_once(&dispatch_once, choose);
  dots_impl(dtype, a, b, n, out);
}

void gs_cpu_adasum_combine(gs_dtype_t dtype, double ca, const void *a, double cb, const void *b,
                           void *out, int64_t n) {
  pthread_once(&dispatch_once, choose);
  combine_impl(dtype, ca, a, cb, b, out, n);
}
