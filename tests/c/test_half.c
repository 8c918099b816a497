/* float16 and bfloat16 conversions: src/base/half.h checked exhaustively (all
 * 65536 patterns each way) and on large samples of float32 values (ties,
 * subnormals, overflow, NaN) against the references in gs_test.h; then the
 * same conversions seen through the library's public behaviour (prescale and
 * the float16/bfloat16 sum). The work is split across ranks; the collective
 * checks run on every rank. */
#include "gs_test.h"
#include "../../src/base/half.h" /* internal, allowed in tests */

static int rank_, size_;

/* ---- direct checks of half.h --------------------------------------------- */

static void check_f16_from_float(float f, long long *bad) {
  uint16_t got = gs_float_to_half(f);
  uint16_t want = gs_ref_double_to_f16((double)f);
  int ok;
  if (isnan(f)) ok = gs_ref_f16_isnan(got) && (got >> 15) == (gs_ref_f32_bits(f) >> 31);
  else ok = got == want;
#if GS_TEST_HAVE_FLOAT16
  if (!isnan(f)) { /* the two references must agree, or the test is wrong */
    uint16_t cc = gs_ref_float_to_f16_cc(f);
    if (cc != want && (*bad)++ < 5)
      CHECK(0, "references disagree for float %a: _Float16 0x%04x, arithmetic 0x%04x", (double)f,
            cc, want);
  }
#endif
  if (!ok && (*bad)++ < 5)
    CHECK(0, "gs_float_to_half(%a = 0x%08x) = 0x%04x, expected 0x%04x", (double)f,
          gs_ref_f32_bits(f), got, want);
}

static void check_bf16_from_float(float f, long long *bad) {
  uint16_t got = gs_float_to_bf16(f);
  uint16_t want = gs_ref_double_to_bf16((double)f);
  int ok;
  if (isnan(f)) ok = gs_ref_bf16_isnan(got) && (got >> 15) == (gs_ref_f32_bits(f) >> 31);
  else ok = got == want;
  if (!ok && (*bad)++ < 5)
    CHECK(0, "gs_float_to_bf16(%a = 0x%08x) = 0x%04x, expected 0x%04x", (double)f,
          gs_ref_f32_bits(f), got, want);
}

static void test_all_patterns(void) {
  SECTION("float16: all 65536 patterns");
  long long bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = gs_half_to_float((uint16_t)h);
    double want = gs_ref_f16_to_double((uint16_t)h);
    int nan = gs_ref_f16_isnan((uint16_t)h);
    int ok = nan ? (isnan(f) && !!signbit(f) == (int)(h >> 15))
                 : ((double)f == want && !!signbit(f) == !!signbit(want));
#if GS_TEST_HAVE_FLOAT16
    float cc = gs_ref_f16_to_float_cc((uint16_t)h);
    if (!nan) ok = ok && gs_ref_f32_bits(cc) == gs_ref_f32_bits(f);
#endif
    uint16_t back = gs_float_to_half(f);
    /* round trip: identical bits, except a NaN may come back quieted */
    int rt = nan ? (gs_ref_f16_isnan(back) && (back & 0x8000u) == (h & 0x8000u) &&
                    ((back | 0x0200u) == (h | 0x0200u)))
                 : back == h;
    if ((!ok || !rt) && bad++ < 5)
      CHECK(0, "half 0x%04x -> float %a -> half 0x%04x (expected value %a)", h, (double)f, back,
            want);
  }
  CHECK(bad == 0, "%lld float16 patterns failed", bad);

  SECTION("bfloat16: all 65536 patterns");
  bad = 0;
  for (uint32_t b = 0; b < 65536; b++) {
    float f = gs_bf16_to_float((uint16_t)b);
    int nan = gs_ref_bf16_isnan((uint16_t)b);
    int ok = nan ? isnan(f) : gs_ref_f32_bits(f) == (b << 16);
    uint16_t back = gs_float_to_bf16(f);
    int rt = nan ? (gs_ref_bf16_isnan(back) && (back | 0x0040u) == (b | 0x0040u)) : back == b;
    if ((!ok || !rt) && bad++ < 5)
      CHECK(0, "bf16 0x%04x -> float %a -> bf16 0x%04x", b, (double)f, back);
  }
  CHECK(bad == 0, "%lld bfloat16 patterns failed", bad);
}

/* Float32 samples, split across ranks: every high part with a set of low
 * parts chosen around the rounding point, plus the exact midpoints between
 * neighbouring half values and the floats next to them. */
static void test_float_samples(void) {
  gs_rng_t rng = gs_rng_make(0x4a1f, rank_);
  long long bad16 = 0, badbf = 0;

  SECTION("float -> float16, sampled");
  static const uint32_t low13[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x0800, 0x17ff};
  for (uint32_t hi = (uint32_t)rank_; hi < (1u << 19); hi += (uint32_t)size_) {
    for (size_t k = 0; k < sizeof low13 / sizeof low13[0]; k++)
      check_f16_from_float(gs_ref_bits_f32((hi << 13) | low13[k]), &bad16);
    check_f16_from_float(gs_ref_bits_f32((hi << 13) | (uint32_t)(gs_rng_next(&rng) & 0x1fff)),
                         &bad16);
  }
  SECTION("float -> float16, midpoints between neighbours");
  for (uint32_t h = (uint32_t)rank_; h < 0x7c00u; h += (uint32_t)size_) {
    double lo = gs_ref_f16_to_double((uint16_t)h);
    double hi = h + 1 < 0x7c00u ? gs_ref_f16_to_double((uint16_t)(h + 1)) : 65536.0;
    float mid = (float)((lo + hi) / 2); /* exact: needs 12 significant bits */
    CHECK((double)mid == (lo + hi) / 2, "midpoint not exact");
    for (int s = 0; s < 2; s++) {
      float m = s ? -mid : mid;
      check_f16_from_float(m, &bad16);
      check_f16_from_float(nextafterf(m, 0.0f), &bad16);
      check_f16_from_float(nextafterf(m, s ? -INFINITY : INFINITY), &bad16);
    }
  }
  SECTION("float -> float16, specials");
  if (rank_ == 0) {
    CHECK(gs_float_to_half(65504.0f) == 0x7bffu, "max finite");
    CHECK(gs_float_to_half(65519.99f) == 0x7bffu, "just below the overflow tie");
    CHECK(gs_float_to_half(65520.0f) == 0x7c00u, "tie to even overflows to inf");
    CHECK(gs_float_to_half(-1e10f) == 0xfc00u, "-overflow");
    CHECK(gs_float_to_half(INFINITY) == 0x7c00u, "inf");
    CHECK(gs_float_to_half(-INFINITY) == 0xfc00u, "-inf");
    CHECK(gs_float_to_half(0x1p-24f) == 0x0001u, "smallest subnormal");
    CHECK(gs_float_to_half(0x1p-25f) == 0x0000u, "half the smallest subnormal ties to 0");
    CHECK(gs_float_to_half(0x1.8p-24f) == 0x0002u, "1.5 * 2^-24 ties to even (2)");
    CHECK(gs_float_to_half(0x1.000002p-25f) == 0x0001u, "just above the tie rounds up");
    CHECK(gs_float_to_half(-0.0f) == 0x8000u, "-0");
    CHECK(gs_float_to_half(0x1.ffcp-15f) == 0x0400u, "largest subnormal rounds up to normal");
    CHECK(gs_ref_f16_isnan(gs_float_to_half(NAN)), "NaN stays NaN");
    CHECK(gs_ref_f16_isnan(gs_float_to_half(gs_ref_bits_f32(0x7f800001u))), "sNaN stays NaN");
    CHECK(gs_ref_f16_isnan(gs_float_to_half(gs_ref_bits_f32(0xff800001u))), "-sNaN stays NaN");
  }
  CHECK(bad16 == 0, "%lld float -> float16 conversions failed", bad16);

  SECTION("float -> bfloat16, sampled");
  static const uint32_t low16[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
  for (uint32_t hi = (uint32_t)rank_; hi < (1u << 16); hi += (uint32_t)size_) {
    for (size_t k = 0; k < sizeof low16 / sizeof low16[0]; k++)
      check_bf16_from_float(gs_ref_bits_f32((hi << 16) | low16[k]), &badbf);
    for (int k = 0; k < 4; k++)
      check_bf16_from_float(gs_ref_bits_f32((hi << 16) | (uint32_t)(gs_rng_next(&rng) & 0xffff)),
                            &badbf);
  }
  SECTION("float -> bfloat16, specials");
  if (rank_ == 0) {
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x7f7fffffu)) == 0x7f80u, "FLT_MAX rounds to inf");
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x7f7f7fffu)) == 0x7f7fu, "below the tie: max finite");
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x3f808000u)) == 0x3f80u, "tie to even, down");
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x3f818000u)) == 0x3f82u, "tie to even, up");
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x00008000u)) == 0x0000u, "subnormal tie to even 0");
    CHECK(gs_float_to_bf16(gs_ref_bits_f32(0x00018000u)) == 0x0002u, "subnormal tie to even 2");
    CHECK(gs_float_to_bf16(-INFINITY) == 0xff80u, "-inf");
    CHECK(gs_ref_bf16_isnan(gs_float_to_bf16(NAN)), "NaN stays NaN");
    CHECK(gs_ref_bf16_isnan(gs_float_to_bf16(gs_ref_bits_f32(0x7f800001u))),
          "sNaN whose payload sits in the low bits stays NaN");
    CHECK(gs_ref_bf16_isnan(gs_float_to_bf16(gs_ref_bits_f32(0xffffffffu))), "all-ones NaN");
  }
  CHECK(badbf == 0, "%lld float -> bfloat16 conversions failed", badbf);
}

/* ---- through the public API ---------------------------------------------- */

/* Every float16/bfloat16 pattern x, prescaled by 0.1 (multiplied in float32
 * and rounded once, as the contract says). Rank 0 sends x, the others +0, so
 * the sum is the prescaled x itself (x + 0 is exact; -0 + +0 is +0). */
static void test_public_scale(gs_comm_t comm) {
  for (int bf = 0; bf < 2; bf++) {
    SECTION("%s through gs_allreduce with prescale 0.1", bf ? "bfloat16" : "float16");
    gs_dtype_t dt = bf ? GS_BFLOAT16 : GS_FLOAT16;
    uint16_t *x = malloc(65536 * 2), *y = malloc(65536 * 2);
    for (uint32_t i = 0; i < 65536; i++) x[i] = rank_ == 0 ? (uint16_t)i : 0;
    gs_tensor_t in = GS_HOST_TENSOR(x, 65536, dt), out = GS_HOST_TENSOR(y, 65536, dt);
    GS_OK(gs_allreduce(comm, &in, &out, 1, GS_OP_SUM, 0.1, 1.0));
    long long bad = 0;
    for (uint32_t i = 0; i < 65536; i++) {
      double v = bf ? gs_ref_bf16_to_double((uint16_t)i) : gs_ref_f16_to_double((uint16_t)i);
      float p = (float)v * 0.1f;                        /* rounded in float32 */
      uint16_t want = bf ? gs_ref_double_to_bf16(p) : gs_ref_double_to_f16(p);
      if (size_ > 1) { /* the other ranks add +0 to the packed value */
        double w = (bf ? gs_ref_bf16_to_double(want) : gs_ref_f16_to_double(want)) + 0.0;
        want = bf ? gs_ref_double_to_bf16(w) : gs_ref_double_to_f16(w);
      }
      int nan = bf ? gs_ref_bf16_isnan((uint16_t)i) : gs_ref_f16_isnan((uint16_t)i);
      int ok = nan ? (bf ? gs_ref_bf16_isnan(y[i]) : gs_ref_f16_isnan(y[i])) : y[i] == want;
      if (!ok && bad++ < 5) CHECK(0, "x = 0x%04x: got 0x%04x, expected 0x%04x", i, y[i], want);
    }
    CHECK(bad == 0, "%lld patterns wrong", bad);
    /* prescale 0.5 (rounded to the dtype when packed), then postscale 2.0
     * (rounded once when unpacked) */
    SECTION("%s: prescale 0.5 then postscale 2.0", bf ? "bfloat16" : "float16");
    GS_OK(gs_allreduce(comm, &in, &out, 1, GS_OP_SUM, 0.5, 2.0));
    bad = 0;
    for (uint32_t i = 0; i < 65536; i++) {
      double v = bf ? gs_ref_bf16_to_double((uint16_t)i) : gs_ref_f16_to_double((uint16_t)i);
      double half_v = (double)(float)(v * 0.5);
      uint16_t h1 = bf ? gs_ref_double_to_bf16(half_v) : gs_ref_double_to_f16(half_v);
      double back = bf ? gs_ref_bf16_to_double(h1) : gs_ref_f16_to_double(h1);
      double w = size_ > 1 ? back + 0.0 : back;
      uint16_t want = bf ? gs_ref_double_to_bf16((double)(float)(w * 2.0))
                         : gs_ref_double_to_f16((double)(float)(w * 2.0));
      int nan = bf ? gs_ref_bf16_isnan((uint16_t)i) : gs_ref_f16_isnan((uint16_t)i);
      int ok = nan ? (bf ? gs_ref_bf16_isnan(y[i]) : gs_ref_f16_isnan(y[i])) : y[i] == want;
      if (!ok && bad++ < 5) CHECK(0, "x = 0x%04x: got 0x%04x, expected 0x%04x", i, y[i], want);
    }
    CHECK(bad == 0, "%lld patterns wrong", bad);
    free(x);
    free(y);
  }
}

/* Two ranks' values summed: one float32 add, rounded once (round to nearest
 * even). With more ranks the extra ranks send 0, which changes nothing
 * (except the sign of a zero). Samples from every rank's RNG stream. */
static void test_public_sum(gs_comm_t comm) {
  enum { N = 1 << 16 };
  for (int bf = 0; bf < 2; bf++) {
    SECTION("%s sum of two ranks, one rounding per step", bf ? "bfloat16" : "float16");
    gs_dtype_t dt = bf ? GS_BFLOAT16 : GS_FLOAT16;
    uint16_t *a = malloc(N * 2), *b = malloc(N * 2), *x = malloc(N * 2);
    gs_rng_t ra = gs_rng_make(77 + bf, 0), rb = gs_rng_make(77 + bf, 1);
    for (int i = 0; i < N; i++) {
      a[i] = (uint16_t)gs_rng_next(&ra);
      b[i] = (uint16_t)gs_rng_next(&rb);
      if (i % 3 == 0) b[i] = (uint16_t)(a[i] ^ 0x8000u) + (uint16_t)(i % 7); /* cancellation */
    }
    for (int i = 0; i < N; i++) x[i] = rank_ == 0 ? a[i] : rank_ == 1 ? b[i] : 0;
    gs_tensor_t t = GS_HOST_TENSOR(x, N, dt);
    GS_OK(gs_allreduce(comm, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0));
    long long bad = 0;
    for (int i = 0; i < N; i++) {
      double va = bf ? gs_ref_bf16_to_double(a[i]) : gs_ref_f16_to_double(a[i]);
      double vb = size_ > 1 ? (bf ? gs_ref_bf16_to_double(b[i]) : gs_ref_f16_to_double(b[i])) : 0.0;
      float s = (float)va + (float)vb; /* one float32 add */
      uint16_t want = bf ? gs_ref_double_to_bf16(s) : gs_ref_double_to_f16(s);
      int wnan = isnan(s);
      int gnan = bf ? gs_ref_bf16_isnan(x[i]) : gs_ref_f16_isnan(x[i]);
      int ok = wnan ? gnan : (x[i] == want || ((x[i] | want) == 0x8000u && s == 0));
      if (size_ == 1) ok = wnan ? gnan : x[i] == a[i];
      if (!ok && bad++ < 5)
        CHECK(0, "0x%04x + 0x%04x: got 0x%04x, expected 0x%04x", a[i], b[i], x[i], want);
    }
    CHECK(bad == 0, "%lld sums wrong", bad);
    free(a);
    free(b);
    free(x);
  }
}

/* double -> float16/bfloat16 must round once: going through float with
 * round-to-nearest would round twice. Hard cases: just above and below every
 * float16 midpoint by less than a float32 ulp, where double rounding errs. */
static void test_double_single_rounding(void) {
  if (rank_ != 0) return;
  SECTION("double -> float16/bfloat16, rounded once");
  long bad16 = 0, bad_bf = 0, n = 0;
  for (uint32_t h = 0; h < 0x7c00u; h++) { /* positive finite float16 */
    double lo = gs_ref_f16_to_double((uint16_t)h), hi = gs_ref_f16_to_double((uint16_t)(h + 1));
    double mid = 0.5 * (lo + hi);
    double eps = ldexp(fabs(mid), -40);
    const double xs[] = {mid, mid + eps, mid - eps, lo + eps, hi - eps};
    for (int k = 0; k < 5; k++, n++) {
      bad16 += gs_double_to_half(xs[k]) != gs_ref_double_to_f16(xs[k]);
      bad16 += gs_double_to_half(-xs[k]) != gs_ref_double_to_f16(-xs[k]);
    }
  }
  gs_rng_t r = gs_rng_make(77, 0);
  for (int i = 0; i < 200000; i++, n++) {
    /* bfloat16 midpoints nudged by less than a float32 ulp, over all exponents */
    uint16_t b = (uint16_t)gs_rng_int(&r, 0, 0x7f7f);
    double lo = gs_ref_bf16_to_double(b), hi = gs_ref_bf16_to_double((uint16_t)(b + 1));
    double mid = 0.5 * (lo + hi), x = mid + (gs_rng_unit(&r) - 0.5) * ldexp(fabs(mid), -30);
    bad_bf += gs_double_to_bf16(x) != gs_ref_double_to_bf16(x);
  }
  CHECK(bad16 == 0, "%ld of %ld float16 conversions rounded twice", bad16, 2 * n);
  CHECK(bad_bf == 0, "%ld bfloat16 conversions rounded twice", bad_bf);
  CHECK(gs_double_to_half(1e300) == 0x7c00u && gs_double_to_bf16(-1e300) == 0xff80u, "overflow");
  CHECK(gs_double_to_half(1e-300) == 0 && gs_double_to_bf16(1e-300) == 0, "underflow to zero");
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_half");
  rank_ = gs_test_rank();
  size_ = gs_test_size();
  if (rank_ == 0) {
    SECTION("reference self-check");
    CHECK(gs_ref_double_to_f16(1.0) == 0x3c00u);
    CHECK(gs_ref_double_to_f16(-2.0) == 0xc000u);
    CHECK(gs_ref_double_to_f16(65504.0) == 0x7bffu);
    CHECK(gs_ref_double_to_f16(0x1p-24) == 0x0001u);
    CHECK(gs_ref_double_to_bf16(1.0) == 0x3f80u);
    CHECK(gs_ref_double_to_bf16(1.0 + 0x1p-8) == 0x3f80u, "tie to even");
    CHECK(gs_ref_double_to_bf16(1.0 + 0x1.8p-7) == 0x3f82u, "tie to even, up");
  }
  test_all_patterns();
  test_float_samples();
  test_double_single_rounding();

  gs_comm_t comm = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));
  test_public_scale(comm);
  test_public_sum(comm);
  GS_OK(gs_comm_free(&comm));
  return gs_test_finish();
}
