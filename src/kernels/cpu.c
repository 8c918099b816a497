/* Gradient control kernels (zero, accumulate, all_finite, scale) on host
 * memory: the fused work list, threading and dispatch. The
 * element loops are elementwise and fixed in their arithmetic, so portable,
 * AVX2 and threaded runs all give the same bits. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels/gs_kernels.h"
#include "base/half.h"
#include "kernels/simd.h"

#define PIECE ((int64_t)1 << 16)             /* elements per work item */
#define PARALLEL_MIN ((int64_t)1 << 20)      /* below this: calling thread only */

/* ---- element loops, portable --------------------------------------------- */

static inline float ld_f(gs_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case GS_FLOAT16: return gs_half_to_float(((const uint16_t *)p)[i]);
    case GS_BFLOAT16: return gs_bf16_to_float(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static inline double ld_d(gs_dtype_t dt, const void *p, int64_t i) {
  return dt == GS_FLOAT64 ? ((const double *)p)[i] : (double)ld_f(dt, p, i);
}

static inline void st_f(gs_dtype_t dt, void *p, int64_t i, float v) {
  switch (dt) {
    case GS_FLOAT16: ((uint16_t *)p)[i] = gs_float_to_half(v); break;
    case GS_BFLOAT16: ((uint16_t *)p)[i] = gs_float_to_bf16(v); break;
    default: ((float *)p)[i] = v; break;
  }
}

/* One rounding from double to each dtype (round to odd on the way for the
 * 16-bit ones, see half.h). */
static inline void st_d(gs_dtype_t dt, void *p, int64_t i, double v) {
  switch (dt) {
    case GS_FLOAT16: ((uint16_t *)p)[i] = gs_double_to_half(v); break;
    case GS_BFLOAT16: ((uint16_t *)p)[i] = gs_double_to_bf16(v); break;
    case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
    default: ((double *)p)[i] = v; break;
  }
}

static void portable_accumulate(gs_dtype_t adt, void *acc, gs_dtype_t gdt, const void *grad,
                                int64_t n, int overwrite) {
  if (adt == GS_FLOAT64 || gdt == GS_FLOAT64) {
    for (int64_t i = 0; i < n; i++)
      st_d(adt, acc, i, overwrite ? ld_d(gdt, grad, i) : ld_d(adt, acc, i) + ld_d(gdt, grad, i));
  } else {
    for (int64_t i = 0; i < n; i++)
      st_f(adt, acc, i, overwrite ? ld_f(gdt, grad, i) : ld_f(adt, acc, i) + ld_f(gdt, grad, i));
  }
}

/* Non-finite: exponent bits all ones. Integer tests, so NaN compares and
 * fast-math never enter. */
static int portable_nonfinite(gs_dtype_t dt, const void *p, int64_t n) {
  int bad = 0;
  switch (dt) {
    case GS_FLOAT16:
      for (int64_t i = 0; i < n; i++) bad |= (((const uint16_t *)p)[i] & 0x7c00u) == 0x7c00u;
      break;
    case GS_BFLOAT16:
      for (int64_t i = 0; i < n; i++) bad |= (((const uint16_t *)p)[i] & 0x7f80u) == 0x7f80u;
      break;
    case GS_FLOAT32:
      for (int64_t i = 0; i < n; i++)
        bad |= (((const uint32_t *)p)[i] & 0x7f800000u) == 0x7f800000u;
      break;
    case GS_FLOAT64:
      for (int64_t i = 0; i < n; i++)
        bad |= (((const uint64_t *)p)[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
      break;
    default: break; /* integers are always finite */
  }
  return bad;
}

/* ---- element loops, AVX2 + F16C -------------------------------------------- */
#ifdef GS_HAVE_X86
GS_AVX2 static void avx2_accumulate(gs_dtype_t adt, void *acc, gs_dtype_t gdt, const void *grad,
                                    int64_t n, int overwrite) {
  int64_t i = 0;
  if (adt != GS_FLOAT64 && gdt != GS_FLOAT64) {
    for (; i + 8 <= n; i += 8) {
      __m256 g = gs_load8(gdt, grad, i);
      gs_store8(adt, acc, i, overwrite ? g : _mm256_add_ps(gs_load8(adt, acc, i), g));
    }
  } else if (adt == GS_FLOAT64 && (gdt == GS_FLOAT64 || gdt == GS_FLOAT32)) {
    for (; i + 4 <= n; i += 4) {
      __m256d g = gdt == GS_FLOAT64 ? _mm256_loadu_pd((const double *)grad + i)
                                    : _mm256_cvtps_pd(_mm_loadu_ps((const float *)grad + i));
      __m256d a = _mm256_loadu_pd((const double *)acc + i);
      _mm256_storeu_pd((double *)acc + i, overwrite ? g : _mm256_add_pd(a, g));
    }
  } else if (adt == GS_FLOAT32 && gdt == GS_FLOAT64) {
    for (; i + 4 <= n; i += 4) {
      __m256d g = _mm256_loadu_pd((const double *)grad + i);
      __m256d a = _mm256_cvtps_pd(_mm_loadu_ps((const float *)acc + i));
      _mm_storeu_ps((float *)acc + i, _mm256_cvtpd_ps(overwrite ? g : _mm256_add_pd(a, g)));
    }
  } /* 16-bit with float64: the portable loop (rare pairs, round to odd) */
  size_t ae = gs_dtype_size(adt), ge = gs_dtype_size(gdt);
  if (i < n)
    portable_accumulate(adt, (char *)acc + (size_t)i * ae, gdt, (const char *)grad + (size_t)i * ge,
                        n - i, overwrite);
}

/* x * factor in float32 (float64 for float64), rounded once: the same
 * arithmetic as gs_cpu_scale_copy, eight elements at a time. */
GS_AVX2 static void avx2_scale(gs_dtype_t dt, void *p, int64_t n, double factor) {
  int64_t i = 0;
  if (dt == GS_FLOAT64) {
    const __m256d f = _mm256_set1_pd(factor);
    for (; i + 4 <= n; i += 4)
      _mm256_storeu_pd((double *)p + i, _mm256_mul_pd(_mm256_loadu_pd((double *)p + i), f));
  } else {
    const __m256 f = _mm256_set1_ps((float)factor);
    for (; i + 8 <= n; i += 8) gs_store8(dt, p, i, _mm256_mul_ps(gs_load8(dt, p, i), f));
  }
  if (i < n) {
    char *q = (char *)p + (size_t)i * gs_dtype_size(dt);
    gs_cpu_scale_copy(dt, q, q, n - i, factor);
  }
}

GS_AVX2 static int avx2_nonfinite(gs_dtype_t dt, const void *p, int64_t n) {
  /* the same integer tests; the compiler vectorizes them with AVX2 here */
  return portable_nonfinite(dt, p, n);
}
#endif

/* ---- dispatch ---------------------------------------------------------------- */

typedef void (*accumulate_fn)(gs_dtype_t, void *, gs_dtype_t, const void *, int64_t, int);
typedef int (*nonfinite_fn)(gs_dtype_t, const void *, int64_t);
typedef void (*scale_fn)(gs_dtype_t, void *, int64_t, double);

static void portable_scale(gs_dtype_t dt, void *p, int64_t n, double factor) {
  gs_cpu_scale_copy(dt, p, p, n, factor);
}

static scale_fn pick_scale(void) {
#ifdef GS_HAVE_X86
  if (gs_simd_avx2()) return avx2_scale;
#endif
  return portable_scale;
}

static accumulate_fn pick_accumulate(void) {
#ifdef GS_HAVE_X86
  if (gs_simd_avx2()) return avx2_accumulate;
#endif
  return portable_accumulate;
}

static nonfinite_fn pick_nonfinite(void) {
#ifdef GS_HAVE_X86
  if (gs_simd_avx2()) return avx2_nonfinite;
#endif
  return portable_nonfinite;
}

/* ---- the fused work list ------------------------------------------------------ */

typedef struct item {
  int64_t pair; /* which tensor (pair) */
  int64_t first, count;
} item_t;

/* Splits n tensors into items of at most PIECE elements. */
static gs_status_t work_list(const gs_tensor_t *t, int64_t n, item_t **out, int64_t *nitems,
                             int64_t *total) {
  int64_t k = 0;
  *total = 0;
  for (int64_t i = 0; i < n; i++) {
    k += (t[i].count + PIECE - 1) / PIECE;
    *total += t[i].count;
  }
  item_t *it = malloc((size_t)(k > 0 ? k : 1) * sizeof *it);
  if (!it) return gs_fail(GS_ERR_NO_MEMORY, "kernels: out of memory for the work list");
  k = 0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t f = 0; f < t[i].count; f += PIECE) {
      it[k].pair = i;
      it[k].first = f;
      it[k].count = t[i].count - f < PIECE ? t[i].count - f : PIECE;
      k++;
    }
  *out = it;
  *nitems = k;
  return GS_SUCCESS;
}

static int threads_for(int64_t total) {
#ifdef _OPENMP
  if (total < PARALLEL_MIN) return 1;
  static int configured = -1;
  if (configured < 0) {
    int v = gs_env_num_threads();
    configured = v > 0 ? v : omp_get_max_threads();
  }
  return configured;
#else
  (void)total;
  return 1;
#endif
}

/* ---- over tensor lists (arguments checked by coll/kernels.c) ----------------------- */

void gs_cpu_zero(const gs_tensor_t *t, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (t[i].count) memset(t[i].data, 0, (size_t)t[i].count * gs_dtype_size(t[i].dtype));
}

gs_status_t gs_cpu_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                              int overwrite) {
  item_t *it;
  int64_t k, total;
  GS_CHECK(work_list(acc, n, &it, &k, &total));
  accumulate_fn f = pick_accumulate();
#pragma omp parallel for schedule(static) num_threads(threads_for(total)) if (total >= PARALLEL_MIN)
  for (int64_t j = 0; j < k; j++) {
    const gs_tensor_t *a = &acc[it[j].pair], *g = &grad[it[j].pair];
    f(a->dtype, (char *)a->data + (size_t)it[j].first * gs_dtype_size(a->dtype), g->dtype,
      (const char *)g->data + (size_t)it[j].first * gs_dtype_size(g->dtype), it[j].count,
      overwrite);
  }
  free(it);
  return GS_SUCCESS;
}

gs_status_t gs_cpu_nonfinite(const gs_tensor_t *t, int64_t n, int *any) {
  item_t *it;
  int64_t k, total;
  GS_CHECK(work_list(t, n, &it, &k, &total));
  nonfinite_fn f = pick_nonfinite();
  int bad = 0;
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(total)) if (total >= PARALLEL_MIN) reduction(| : bad)
  for (int64_t j = 0; j < k; j++) {
    if (bad) continue; /* found already: skip the rest of this thread's share */
    const gs_tensor_t *x = &t[it[j].pair];
    bad |= f(x->dtype, (const char *)x->data + (size_t)it[j].first * gs_dtype_size(x->dtype),
             it[j].count);
  }
  free(it);
  *any = bad;
  return GS_SUCCESS;
}

gs_status_t gs_cpu_scale(const gs_tensor_t *t, int64_t n, double factor) {
  if (factor == 1.0) return GS_SUCCESS; /* times one: nothing to do */
  item_t *it;
  int64_t k, total;
  GS_CHECK(work_list(t, n, &it, &k, &total));
  scale_fn f = pick_scale();
#pragma omp parallel for schedule(static) num_threads(threads_for(total)) if (total >= PARALLEL_MIN)
  for (int64_t j = 0; j < k; j++) {
    const gs_tensor_t *x = &t[it[j].pair];
    f(x->dtype, (char *)x->data + (size_t)it[j].first * gs_dtype_size(x->dtype), it[j].count,
      factor);
  }
  free(it);
  return GS_SUCCESS;
}
