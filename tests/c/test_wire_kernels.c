/* The float8 wire encoder's bit-level conversion (to_fp8_bits, the fast
 * path) against its arithmetic reference (to_fp8: frexp/nearbyint in double,
 * the conversion ml_dtypes' float8_e4m3fn and float8_e5m2 make, which
 * tests/python/test_wire.py checks against ml_dtypes itself), for every
 * float32 bit pattern of both signs in a stride that visits each exponent's
 * significands densely, plus ties, subnormal boundaries and overflow; then a
 * whole encode/decode of a shard against an element-by-element reference;
 * and the AVX2 encoders (float8, bfloat16, float16) against the portable
 * loops. The patterns are split across ranks. */
#include "gs_test.h"
#include "../../src/kernels/cpu_wire.c" /* the static converters, as compiled in the library */
#include "gs_info.h"

/* The library's dispatch (hidden in it), through the exported level. */
int gs_simd_avx2(void) { return strcmp(gs_simd_level(), "avx2") == 0; }

static int rank_, size_;

static void check_one(gs_wire_t wire, const char *name, float v, long long *bad) {
  const fp8_format_t *f = fp8(wire);
  uint8_t got = to_fp8_bits(f, v), want = to_fp8(f, v);
  if (got != want && (*bad)++ < 5)
    CHECK(0, "%s: to_fp8_bits(%a) = 0x%02x, reference 0x%02x", name, (double)v, got, want);
}

/* Every pattern u = k * STRIDE (STRIDE odd, so every low-bit residue
 * occurs), both signs: about 2^32 / STRIDE values per format. */
static void test_patterns(gs_wire_t wire, const char *name) {
  const uint64_t stride = 97;
  long long bad = 0, n = 0;
  for (uint64_t u = (uint64_t)rank_ * stride; u < (1ull << 32); u += stride * (uint64_t)size_) {
    uint32_t bits = (uint32_t)u;
    float v;
    memcpy(&v, &bits, sizeof v);
    check_one(wire, name, v, &bad);
    n++;
  }
  CHECK(bad == 0, "%s: %lld of %lld patterns differ", name, bad, n);
}

/* Values the stride may miss: ties between neighbouring codes (exactly
 * halfway, and one float32 ulp either side), the subnormal/normal boundary,
 * the largest finite value and just past it, zero, infinities, NaN. */
static void test_edges(gs_wire_t wire, const char *name) {
  const fp8_format_t *f = fp8(wire);
  long long bad = 0;
  for (int code = 0; code < 0x7f; code++) {
    float lo = from_fp8(f, (uint8_t)code), hi = from_fp8(f, (uint8_t)(code + 1));
    if (!isfinite(lo) || !isfinite(hi)) continue;
    float mid = (float)(((double)lo + (double)hi) / 2);
    float probes[] = {lo, hi, mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
    for (unsigned p = 0; p < sizeof probes / sizeof probes[0]; p++) {
      check_one(wire, name, probes[p], &bad);
      check_one(wire, name, -probes[p], &bad);
    }
  }
  float specials[] = {0.0f,
                      -0.0f,
                      INFINITY,
                      -INFINITY,
                      NAN,
                      (float)f->max,
                      nextafterf((float)f->max, INFINITY),
                      (float)f->max * 1.0625f,
                      1e30f,
                      0x1p-149f,
                      0x1p-126f};
  for (unsigned i = 0; i < sizeof specials / sizeof specials[0]; i++) {
    check_one(wire, name, specials[i], &bad);
    check_one(wire, name, -specials[i], &bad);
  }
  CHECK(bad == 0, "%s: %lld edge values differ", name, bad);
}

/* gs_wire_encode/gs_wire_decode of a shard (a partial last block, scales
 * spanning many binades, a zero block) against scale-then-reference. */
static void test_shard(gs_wire_t wire, const char *name) {
  enum { N = 3 * GS_WIRE_BLOCK + 7 };
  float x[N], back[N], lost[N] = {0};
  uint8_t buf[N + N / GS_WIRE_BLOCK + 1];
  for (int i = 0; i < N; i++)
    x[i] = (i / GS_WIRE_BLOCK == 1) ? 0.0f : ldexpf((float)(i % 13) - 6.3f, (i * 7) % 40 - 20);
  gs_wire_encode(wire, x, N, buf, lost);
  gs_wire_decode(wire, buf, N, back);
  long long bad = 0;
  const fp8_format_t *f = fp8(wire);
  const uint8_t *elems = buf + (N + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK;
  for (int i = 0; i < N; i++) {
    int s = (int)buf[i / GS_WIRE_BLOCK] - 127;
    uint8_t want = to_fp8(f, ldexp((double)x[i], -s));
    float want_back = from_fp8(f, want) * ldexpf(1.0f, s);
    if ((elems[i] != want || back[i] != want_back || lost[i] != x[i] - want_back) && bad++ < 5)
      CHECK(0, "%s shard element %d: 0x%02x (want 0x%02x), decoded %a (want %a)", name, i, elems[i],
            want, (double)back[i], (double)want_back);
  }
  CHECK(bad == 0, "%s: %lld shard elements differ", name, bad);
}

/* The AVX2 encoders against the portable loops (float8's held to the
 * reference above, the halves' to half.h's converters): blocks of raw random bit patterns (NaN, infinities, subnormals,
 * every binade), blocks of scaled values with one special value each, and
 * error-feedback residuals that start random: bytes and residuals bit for
 * bit. Where the CPU has no AVX2 both runs take the portable loop. */
static void test_simd_blocks(gs_wire_t wire, const char *name) {
  enum { NB = 4099, N = NB * GS_WIRE_BLOCK + 5 };
  static const float special[] = {NAN, INFINITY, -INFINITY, 0x1p-140f, -0.0f, 3e38f};
  float *x = malloc(N * sizeof *x), *lost[2];
  uint8_t *out[2];
  uint32_t r = 12345u;
  for (int i = 0; i < N; i++) {
    r = r * 1664525u + 1013904223u;
    int b = i / GS_WIRE_BLOCK;
    if (b % 3 == 0) memcpy(&x[i], &r, sizeof r);
    else x[i] = ldexpf((float)(int32_t)r * 0x1p-31f, b % 80 - 40);
    if (b % 3 == 2 && i % GS_WIRE_BLOCK == b % GS_WIRE_BLOCK) x[i] = special[b % 6];
  }
  for (int k = 0; k < 2; k++) {
    lost[k] = malloc(N * sizeof(float));
    out[k] = malloc((size_t)gs_wire_bytes(wire, N));
    for (int i = 0; i < N; i++) lost[k][i] = (i % 7 == 0) ? -0.0f : (float)(i % 11) * 0x1p-20f;
    if (k) setenv("GRADSYNC_SIMD", "portable", 1);
    gs_wire_encode(wire, x, N, out[k], lost[k]);
    unsetenv("GRADSYNC_SIMD");
  }
  CHECK(memcmp(out[0], out[1], (size_t)gs_wire_bytes(wire, N)) == 0,
        "%s: the AVX2 encoder's bytes differ from the portable loop's", name);
  CHECK(memcmp(lost[0], lost[1], N * sizeof(float)) == 0,
        "%s: the AVX2 encoder's residuals differ from the portable loop's", name);
  /* decoding those bytes (NaN, infinities and subnormals among them), and
   * adding them to float32 values, the same bits either way too */
  for (int add = 0; add < 2; add++) {
    for (int k = 0; k < 2; k++) {
      memcpy(lost[k], x, N * sizeof(float));
      if (k) setenv("GRADSYNC_SIMD", "portable", 1);
      if (add) gs_wire_decode_add(wire, out[0], N, lost[k]);
      else gs_wire_decode(wire, out[0], N, lost[k]);
      unsetenv("GRADSYNC_SIMD");
    }
    CHECK(memcmp(lost[0], lost[1], N * sizeof(float)) == 0,
          "%s: the AVX2 %s differs from the portable loop's", name, add ? "decode_add" : "decode");
  }
  for (int k = 0; k < 2; k++) {
    free(lost[k]);
    free(out[k]);
  }
  free(x);
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_wire_kernels");
  rank_ = gs_test_rank();
  size_ = gs_test_size();
  const struct {
    gs_wire_t wire;
    const char *name;
  } formats[] = {{GS_WIRE_FLOAT8_E4M3, "float8_e4m3"}, {GS_WIRE_FLOAT8_E5M2, "float8_e5m2"}};
  for (int k = 0; k < 2; k++) {
    SECTION(formats[k].name);
    if (rank_ == 0) {
      CHECK(to_fp8_bits(fp8(formats[k].wire), 1.0f) ==
                (uint8_t)(fp8(formats[k].wire)->bias << fp8(formats[k].wire)->mbits),
            "1.0 is the bias as exponent, significand 0");
      test_edges(formats[k].wire, formats[k].name);
      test_shard(formats[k].wire, formats[k].name);
      test_simd_blocks(formats[k].wire, formats[k].name);
    }
    test_patterns(formats[k].wire, formats[k].name);
  }
  SECTION("bfloat16 and float16");
  if (rank_ == 0) {
    test_simd_blocks(GS_WIRE_BFLOAT16, "bfloat16");
    test_simd_blocks(GS_WIRE_FLOAT16, "float16");
  }
  return gs_test_finish();
}
