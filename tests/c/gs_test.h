/* Tiny helpers shared by the C tests of gradsync (header only).
 *
 *   gs_test_init(&argc, &argv, "test_name")   MPI_Init + bookkeeping
 *   SECTION("allreduce %s", name)             names what the next failures are about
 *   CHECK(cond, fmt, ...)                     records a failure with file:line and rank
 *   GS_OK(call)                               CHECK that a gradsync call returns GS_SUCCESS
 *                                             (prints gs_last_error()); evaluates to 1 if it did
 *   GS_EXPECT(call, status)                   CHECK that a call returns exactly `status`
 *   return gs_test_finish();                  collective summary, MPI_Finalize, exit code
 *   gs_test_stderr_begin(); ... text = gs_test_stderr_end();
 *                                             gradsync's log lines a deliberate fault
 *                                             provokes, for CHECK_LOGGED(text, "...")
 *
 * A failing CHECK never returns early: every rank keeps making the same
 * collective calls, so a failure can never leave a rank waiting.
 *
 * Also: a deterministic per-rank RNG (splitmix64), so every rank can
 * regenerate every other rank's inputs for a reference, a byte hash for
 * cross-rank bitwise comparisons, and float16/bfloat16 reference conversions
 * written independently of src/base/half.h. */
#ifndef GS_TEST_H
#define GS_TEST_H

#include <math.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gradsync.h"

/* ---- bookkeeping --------------------------------------------------------- */

#define GS_TEST_MAX_PRINTED 25 /* failure lines printed per rank */

static long long gs_test_passed_, gs_test_failed_;
static int gs_test_rank_ = -1, gs_test_size_ = 0;
static const char *gs_test_name_ = "test";
static char gs_test_section_[256] = "";

static inline int gs_test_rank(void) { return gs_test_rank_; }
static inline int gs_test_size(void) { return gs_test_size_; }

/* MPI_Init_thread at `level`; returns the level MPI provides. */
static inline int gs_test_init_thread(int *argc, char ***argv, const char *name, int level) {
  int provided = 0;
  MPI_Init_thread(argc, argv, level, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &gs_test_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &gs_test_size_);
  gs_test_name_ = name;
  setvbuf(stdout, NULL, _IOLBF, 0);
  return provided;
}

static inline void gs_test_init(int *argc, char ***argv, const char *name) {
  MPI_Init(argc, argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &gs_test_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &gs_test_size_);
  gs_test_name_ = name;
  setvbuf(stdout, NULL, _IOLBF, 0);
}

__attribute__((format(printf, 1, 2)))
static inline void SECTION(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(gs_test_section_, sizeof gs_test_section_, fmt, ap);
  va_end(ap);
}

__attribute__((format(printf, 5, 6)))
static inline int gs_test_check_(int ok, const char *cond, const char *file, int line,
                                 const char *fmt, ...) {
  if (ok) {
    gs_test_passed_++;
    return 1;
  }
  gs_test_failed_++;
  if (gs_test_failed_ <= GS_TEST_MAX_PRINTED) {
    char msg[1024] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *m = msg[0] == ' ' ? msg + 1 : msg; /* CHECK's format starts with a space */
    fprintf(stderr, "%s:%d: [rank %d] FAILED%s%s%s: %s%s%s\n", file, line, gs_test_rank_,
            gs_test_section_[0] ? " (" : "", gs_test_section_, gs_test_section_[0] ? ")" : "",
            cond, m[0] ? ": " : "", m);
    if (gs_test_failed_ == GS_TEST_MAX_PRINTED)
      fprintf(stderr, "[rank %d] (further failures are counted, not printed)\n", gs_test_rank_);
    fflush(stderr);
  }
  return 0;
}

/* CHECK(cond, fmt, ...): the message is optional (CHECK(x == 1) works). */
#define CHECK(cond, ...) gs_test_check_(!!(cond), #cond, __FILE__, __LINE__, " " __VA_ARGS__)

static inline int gs_test_ok_(gs_status_t s, const char *call, const char *file, int line) {
  return gs_test_check_(s == GS_SUCCESS, call, file, line, "returned %d (%s): %s", (int)s,
                        gs_status_string(s), gs_last_error());
}
#define GS_OK(call) gs_test_ok_((call), #call, __FILE__, __LINE__)

static inline int gs_test_expect_(gs_status_t got, gs_status_t want, const char *call,
                                  const char *file, int line) {
  return gs_test_check_(got == want, call, file, line, "returned %d, expected %d; last error: %s",
                        (int)got, (int)want, gs_last_error());
}
#define GS_EXPECT(call, status) gs_test_expect_((call), (status), #call, __FILE__, __LINE__)

/* Whether the last error mentions `needle` (records a failure if not). */
#define CHECK_ERROR_MENTIONS(needle) \
  CHECK(strstr(gs_last_error(), (needle)) != NULL, "gs_last_error() = \"%s\" lacks \"%s\"", \
        gs_last_error(), (needle))

/* ---- log lines a deliberate fault provokes ------------------------------ */

/* A test that provokes a fault on purpose (a timeout, an NCCL error, a
 * communicator freed after one) makes gradsync log "[gradsync rank N]
 * ERROR: ..." or "WARNING: ..." on stderr, which would read as a problem in a
 * passing run. gs_test_stderr_begin() sends this process's stderr to an
 * unnamed temporary file (nothing is left behind); gs_test_stderr_end() puts
 * stderr back and returns what was written (up to 64 KiB), first printing
 * again every line that is not one of gradsync's log lines (a failed
 * CHECK's, MPI's), so nothing else is hidden. The test then checks the
 * lines it expects: CHECK_LOGGED(text, "aborting the NCCL communicator"),
 * `text` a variable (CHECK may evaluate its arguments in any order). */
static char gs_test_stderr_text_[65536];
static FILE *gs_test_stderr_file_;
static int gs_test_stderr_saved_ = -1;

static inline void gs_test_stderr_begin(void) {
  fflush(stderr);
  gs_test_stderr_file_ = tmpfile();
  if (!gs_test_stderr_file_) return; /* then the lines are printed, not checked */
  gs_test_stderr_saved_ = dup(2);
  dup2(fileno(gs_test_stderr_file_), 2);
}

static inline const char *gs_test_stderr_end(void) {
  gs_test_stderr_text_[0] = '\0';
  if (gs_test_stderr_saved_ < 0) return gs_test_stderr_text_;
  fflush(stderr);
  dup2(gs_test_stderr_saved_, 2);
  close(gs_test_stderr_saved_);
  gs_test_stderr_saved_ = -1;
  rewind(gs_test_stderr_file_);
  size_t n = fread(gs_test_stderr_text_, 1, sizeof gs_test_stderr_text_ - 1, gs_test_stderr_file_);
  gs_test_stderr_text_[n] = '\0';
  fclose(gs_test_stderr_file_);
  for (const char *line = gs_test_stderr_text_; *line;) {
    const char *end = strchr(line, '\n');
    int len = end ? (int)(end - line) : (int)strlen(line);
    if (strncmp(line, "[gradsync rank ", 15) != 0) fprintf(stderr, "%.*s\n", len, line);
    line += len + (end != NULL);
  }
  fflush(stderr);
  return gs_test_stderr_text_;
}

/* Whether what was captured so far has `needle` (to wait for a line another
 * thread writes; the capture goes on). */
static inline int gs_test_stderr_has(const char *needle) {
  if (gs_test_stderr_saved_ < 0) return 0;
  fflush(stderr);
  ssize_t n = pread(fileno(gs_test_stderr_file_), gs_test_stderr_text_,
                    sizeof gs_test_stderr_text_ - 1, 0);
  gs_test_stderr_text_[n > 0 ? n : 0] = '\0';
  return strstr(gs_test_stderr_text_, needle) != NULL;
}

/* Whether `text` (from gs_test_stderr_end) has `needle` (a failure if not). */
#define CHECK_LOGGED(text, needle) \
  CHECK(strstr((text), (needle)) != NULL, "stderr lacks \"%s\"; it has: %s", (needle), (text))
/* Whether gradsync logged nothing into `text` (a failure if it did). */
#define CHECK_NOTHING_LOGGED(text) \
  CHECK(strstr((text), "[gradsync rank ") == NULL, "unexpected log lines: %s", (text))

/* Collective over MPI_COMM_WORLD: sums the counts of every rank, rank 0
 * prints "name: N passed, M failed", then MPI_Finalize. Returns the exit code
 * (non-zero on every rank if any rank failed). */
static inline int gs_test_finish(void) {
  long long mine[2] = {gs_test_passed_, gs_test_failed_}, all[2] = {0, 0};
  MPI_Allreduce(mine, all, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (gs_test_rank_ == 0) {
    printf("%s (%d ranks): %lld passed, %lld failed\n", gs_test_name_, gs_test_size_, all[0],
           all[1]);
    fflush(stdout);
  }
  MPI_Finalize();
  return all[1] ? 1 : 0;
}

/* Collective: whether `v` is the same on every rank of `comm`. */
static inline int gs_test_same_u64(MPI_Comm comm, uint64_t v) {
  uint64_t mm[2] = {v, ~v}, r[2];
  MPI_Allreduce(mm, r, 2, MPI_UINT64_T, MPI_MAX, comm);
  return r[0] == v && r[1] == ~v;
}

/* ---- deterministic RNG (splitmix64) ------------------------------------- */

typedef struct gs_rng {
  uint64_t s;
} gs_rng_t;

static inline uint64_t gs_rng_next(gs_rng_t *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The stream of (case, rank): any rank can regenerate any other's inputs. */
static inline gs_rng_t gs_rng_make(uint64_t case_id, int rank) {
  gs_rng_t r = {case_id * 0x2545f4914f6cdd1dull + (uint64_t)(rank + 1) * 0x9e3779b97f4a7c15ull};
  gs_rng_next(&r);
  return r;
}

/* Uniform integer in [lo, hi]. */
static inline int64_t gs_rng_int(gs_rng_t *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(gs_rng_next(r) % (uint64_t)(hi - lo + 1));
}

/* Uniform double in [0, 1). */
static inline double gs_rng_unit(gs_rng_t *r) { return (double)(gs_rng_next(r) >> 11) * 0x1p-53; }

/* ---- hashing ------------------------------------------------------------- */

static inline uint64_t gs_hash_bytes(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  if (!h) h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* ---- float16 / bfloat16 references (independent of src/base/half.h) ----- */

static inline uint32_t gs_ref_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float gs_ref_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Rounds x to a binary format with `p` significant bits (hidden bit
 * included), minimum normal exponent `emin` (value 2^emin) and largest finite
 * value (2 - 2^(1-p)) * 2^emax, to nearest, ties to even. Returns the rounded
 * value as a double (exact), +-inf on overflow, NaN for NaN. Pure arithmetic:
 * scaling by powers of two is exact, rint() rounds ties to even. */
static inline double gs_ref_round_format(double x, int p, int emin, int emax) {
  if (isnan(x) || isinf(x) || x == 0) return x;
  int e;
  frexp(fabs(x), &e);           /* |x| = m * 2^e, m in [0.5, 1) */
  int exp = e - 1;              /* |x| = 1.f * 2^exp */
  if (exp < emin) exp = emin;   /* subnormal: fixed quantum */
  double quantum = ldexp(1.0, exp - (p - 1));
  double q = rint(x / quantum); /* exact division by a power of two */
  double r = q * quantum;
  if (fabs(r) >= ldexp(1.0, emax + 1)) return copysign(INFINITY, x);
  return r;
}

/* float16 = binary16: p = 11, emin = -14, emax = 15. */
static inline uint16_t gs_ref_double_to_f16(double x) {
  if (isnan(x)) return (uint16_t)((signbit(x) ? 0x8000u : 0) | 0x7e00u);
  double r = gs_ref_round_format(x, 11, -14, 15);
  uint16_t sign = signbit(r) ? 0x8000u : 0;
  double a = fabs(r);
  if (isinf(a)) return sign | 0x7c00u;
  if (a < 0x1p-14) return sign | (uint16_t)(a * 0x1p24); /* subnormal or zero */
  int e;
  double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  uint16_t bexp = (uint16_t)(e - 1 + 15);
  uint16_t man = (uint16_t)((m * 2.0 - 1.0) * 1024.0);
  return sign | (uint16_t)(bexp << 10) | man;
}

static inline double gs_ref_f16_to_double(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  double v;
  if (exp == 31) v = man ? NAN : INFINITY;
  else if (exp == 0) v = ldexp((double)man, -24);
  else v = ldexp(1024.0 + man, exp - 25);
  return sign ? -v : v;
}

/* bfloat16 = the top half of binary32: p = 8, emin = -126, emax = 127. */
static inline uint16_t gs_ref_double_to_bf16(double x) {
  if (isnan(x)) return (uint16_t)((signbit(x) ? 0x8000u : 0) | 0x7fc0u);
  double r = gs_ref_round_format(x, 8, -126, 127);
  /* r is a bfloat16 value, so it is exact in float and its low 16 bits are 0 */
  return (uint16_t)(gs_ref_f32_bits((float)r) >> 16);
}

static inline double gs_ref_bf16_to_double(uint16_t b) {
  return (double)gs_ref_bits_f32((uint32_t)b << 16);
}

/* Whether a float16 / bfloat16 bit pattern is a NaN. */
static inline int gs_ref_f16_isnan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu); }
static inline int gs_ref_bf16_isnan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu); }

#if defined(__FLT16_MAX__)
#define GS_TEST_HAVE_FLOAT16 1
/* Second, compiler-provided float16 reference (GCC's _Float16). */
static inline uint16_t gs_ref_float_to_f16_cc(float f) {
  _Float16 h = (_Float16)f;
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
static inline float gs_ref_f16_to_float_cc(uint16_t u) {
  _Float16 h;
  memcpy(&h, &u, 2);
  return (float)h;
}
#else
#define GS_TEST_HAVE_FLOAT16 0
#endif

#endif
