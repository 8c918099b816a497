/* Adasum's host kernels: the AVX2/F16C path gives the same bits as the
 * portable path for every dtype, length and value class (subnormal, huge,
 * NaN, inf), and the portable dots match an independent float64 loop in the
 * documented lane order. The kernel file is compiled into this test so both
 * paths can be called directly. */
#include "gs_test.h"

#include "../../src/kernels/cpu_adasum.c"

/* The library's dispatcher is internal; this test calls both paths itself. */
int gs_simd_avx2(void) { return 0; }

static void fill(gs_rng_t *r, gs_dtype_t dt, void *p, int64_t n, int specials) {
  for (int64_t i = 0; i < n; i++) {
    double v = (gs_rng_unit(r) - 0.5) * 8.0;
    int64_t k = specials ? gs_rng_int(r, 0, 40) : 40;
    if (k == 0) v = 1e-41;                 /* float32 subnormal */
    else if (k == 1) v = 6e-8;             /* float16 subnormal */
    else if (k == 2) v = 3e38;
    else if (k == 3) v = -0.0;
    switch (dt) {
      case GS_FLOAT16: ((uint16_t *)p)[i] = gs_float_to_half((float)v); break;
      case GS_BFLOAT16: ((uint16_t *)p)[i] = gs_float_to_bf16((float)v); break;
      case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
      default: ((double *)p)[i] = v; break;
    }
  }
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_adasum_kernels");
  static const gs_dtype_t dts[] = {GS_FLOAT16, GS_BFLOAT16, GS_FLOAT32, GS_FLOAT64};
  static const int64_t lens[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4099};
  static const double coef[][2] = {{1.0, 1.0}, {0.75, 1.25}, {1e40, 1e-40}, {-3.5, 0.1}};
  double a[4100], b[4100], o1[4100], o2[4100]; /* storage for any dtype */
#ifdef GS_HAVE_X86
  __builtin_cpu_init();
  int have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  int have_avx2 = 0;
#endif
  if (gs_test_rank() == 0) {
    for (int d = 0; d < 4; d++)
      for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (int specials = 0; specials < 2; specials++) {
          gs_dtype_t dt = dts[d];
          int64_t n = lens[li];
          gs_rng_t r = gs_rng_make((uint64_t)(d * 1000 + li * 10 + specials), 0);
          fill(&r, dt, a, n, specials);
          fill(&r, dt, b, n, specials);
          SECTION("%s n=%lld specials=%d", gs_dtype_name(dt), (long long)n, specials);
          /* independent reference of the documented order: lane i % 8 */
          double lane[3][LANES] = {{0}};
          for (int64_t i = 0; i < n; i++) {
            double x = dt == GS_FLOAT64 ? ((double *)a)[i] : (double)load_elem(dt, a, i);
            double y = dt == GS_FLOAT64 ? ((double *)b)[i] : (double)load_elem(dt, b, i);
            lane[0][i % LANES] += x * y;
            lane[1][i % LANES] += x * x;
            lane[2][i % LANES] += y * y;
          }
          double p[3] = {0}, ref[3];
          for (int k = 0; k < 3; k++) ref[k] = lanes_sum(lane[k]);
          portable_dots(dt, a, b, n, p);
          CHECK(memcmp(p, ref, sizeof p) == 0, "portable dots differ from the reference");
#ifdef GS_HAVE_X86
          if (have_avx2) {
            double v[3] = {0};
            avx2_dots(dt, a, b, n, v);
            CHECK(memcmp(p, v, sizeof p) == 0,
                  "avx2 dots %.17g %.17g %.17g vs portable %.17g %.17g %.17g", v[0], v[1], v[2],
                  p[0], p[1], p[2]);
            for (size_t c = 0; c < sizeof coef / sizeof coef[0]; c++) {
              portable_combine(dt, coef[c][0], a, coef[c][1], b, o1, n);
              avx2_combine(dt, coef[c][0], a, coef[c][1], b, o2, n);
              CHECK(memcmp(o1, o2, (size_t)n * gs_dtype_size(dt)) == 0,
                    "avx2 combine differs (coefficients %g, %g)", coef[c][0], coef[c][1]);
            }
          }
#endif
          /* coefficients past float32's range: float64 math, rounded once */
          if ((dt == GS_FLOAT16 || dt == GS_BFLOAT16) && n > 0) {
            portable_combine(dt, -1e57, a, 1.0, b, o1, n);
            int bad = 0;
            for (int64_t i = 0; i < n; i++) {
              double v = -1e57 * (double)load_elem(dt, a, i) + (double)load_elem(dt, b, i);
              uint16_t want = dt == GS_FLOAT16 ? gs_ref_double_to_f16(v) : gs_ref_double_to_bf16(v);
              uint16_t got = ((uint16_t *)o1)[i];
              int nan = dt == GS_FLOAT16 ? gs_ref_f16_isnan(want) && gs_ref_f16_isnan(got)
                                         : gs_ref_bf16_isnan(want) && gs_ref_bf16_isnan(got);
              if (got != want && !nan) bad++;
            }
            CHECK(bad == 0, "%d wide combine results differ from the reference", bad);
          }
          /* combine rounds once: float32 result equals the double expression rounded */
          if (dt == GS_FLOAT32 && n > 0) {
            portable_combine(dt, 0.75, a, 1.25, b, o1, n);
            int bad = 0;
            for (int64_t i = 0; i < n; i++) {
              float want = (float)(0.75 * (double)((float *)a)[i] + 1.25 * (double)((float *)b)[i]);
              if (memcmp(&want, &((float *)o1)[i], 4) != 0) bad++;
            }
            CHECK(bad == 0, "%d float32 combine results not rounded once", bad);
          }
        }
    if (!have_avx2) printf("test_adasum_kernels: no AVX2/F16C here: portable path only\n");
  }
  return gs_test_finish();
}
