/* The collectives against references computed from every rank's inputs
 * (each rank regenerates the others' inputs from their RNG streams):
 * gs_allreduce over every op x dtype x list layout x in/out of place,
 * prescale/postscale, mixed-dtype lists, gs_broadcast from every root,
 * gs_allgather_counts + gs_allgatherv, gs_reduce_scatter, gs_block_range,
 * gs_shard_layout (ONNX Runtime's numbers) and the shard collectives.
 * Results must also be bitwise identical on every rank. */
#include "gs_test.h"

static gs_comm_t comm;
static int rank_, size_;

#define NDT GS_NUM_DTYPES
static const gs_dtype_t all_dtypes[NDT] = {GS_FLOAT16, GS_BFLOAT16, GS_FLOAT32, GS_FLOAT64,
                                           GS_INT8,    GS_UINT8,    GS_INT32,   GS_INT64};
static const gs_op_t reduce_ops[5] = {GS_OP_SUM, GS_OP_AVERAGE, GS_OP_MIN, GS_OP_MAX, GS_OP_PROD};

static int is_float(gs_dtype_t d) { return d <= GS_FLOAT64; }

/* ---- element access ------------------------------------------------------ */

static double round_dt(gs_dtype_t dt, double v) {
  switch (dt) {
    case GS_FLOAT16: return gs_ref_f16_to_double(gs_ref_double_to_f16(v));
    case GS_BFLOAT16: return gs_ref_bf16_to_double(gs_ref_double_to_bf16(v));
    case GS_FLOAT32: return (double)(float)v;
    /* integer sums wrap (two's complement), as MPI's do: from 5 ranks on
     * the int8 draws can pass 127 */
    case GS_INT8: return (double)(int8_t)(uint8_t)(int64_t)v;
    case GS_UINT8: return (double)(uint8_t)(int64_t)v;
    default: return v;
  }
}

static void put(gs_dtype_t dt, void *p, int64_t i, double v) {
  switch (dt) {
    case GS_FLOAT16: ((uint16_t *)p)[i] = gs_ref_double_to_f16(v); break;
    case GS_BFLOAT16: ((uint16_t *)p)[i] = gs_ref_double_to_bf16(v); break;
    case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
    case GS_FLOAT64: ((double *)p)[i] = v; break;
    case GS_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case GS_UINT8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case GS_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case GS_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
  }
}

static double get(gs_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case GS_FLOAT16: return gs_ref_f16_to_double(((const uint16_t *)p)[i]);
    case GS_BFLOAT16: return gs_ref_bf16_to_double(((const uint16_t *)p)[i]);
    case GS_FLOAT32: return ((const float *)p)[i];
    case GS_FLOAT64: return ((const double *)p)[i];
    case GS_INT8: return ((const int8_t *)p)[i];
    case GS_UINT8: return ((const uint8_t *)p)[i];
    case GS_INT32: return ((const int32_t *)p)[i];
    case GS_INT64: return (double)((const int64_t *)p)[i];
  }
  return NAN;
}

/* ---- values -------------------------------------------------------------- */

/* RANDOM: floats uniform in [-2, 2) rounded to the dtype; integers in a range
 * whose sum over 4 ranks cannot overflow. DYADIC: k/8, |k| <= 31, so sums over
 * up to 4 ranks are exact in every float dtype (bfloat16 included). PROD:
 * factors whose products over up to 4 ranks are exact. */
enum { K_RANDOM, K_DYADIC, K_PROD };

static double draw(gs_rng_t *r, gs_dtype_t dt, int kind) {
  if (kind == K_PROD) {
    switch (dt) {
      case GS_INT8: return (double)gs_rng_int(r, -2, 2);
      case GS_UINT8: return (double)gs_rng_int(r, 0, 3);
      case GS_INT32: return (double)gs_rng_int(r, -9, 9);
      case GS_INT64: return (double)gs_rng_int(r, -1000, 1000);
      default: { /* +-{1, 1.5} * 2^j, j in [-3, 3] */
        double m = gs_rng_int(r, 0, 1) ? 1.5 : 1.0;
        double v = ldexp(m, (int)gs_rng_int(r, -3, 3));
        return gs_rng_int(r, 0, 1) ? -v : v;
      }
    }
  }
  switch (dt) {
    case GS_INT8: return (double)gs_rng_int(r, -30, 30);
    case GS_UINT8: return (double)gs_rng_int(r, 0, 60);
    case GS_INT32: return (double)gs_rng_int(r, -100000, 100000);
    case GS_INT64: return (double)gs_rng_int(r, -((int64_t)1 << 40), (int64_t)1 << 40);
    default:
      if (kind == K_DYADIC) return (double)gs_rng_int(r, -31, 31) / 8.0;
      return round_dt(dt, gs_rng_unit(r) * 4.0 - 2.0);
  }
}

static double unit_roundoff(gs_dtype_t dt) {
  switch (dt) {
    case GS_FLOAT16: return 0x1p-11;
    case GS_BFLOAT16: return 0x1p-8;
    case GS_FLOAT32: return 0x1p-24;
    case GS_FLOAT64: return 0x1p-53;
    default: return 0;
  }
}

/* x * s as the library scales: in float32 (float64 for float64), rounded once. */
static double scale_dt(gs_dtype_t dt, double x, double s) {
  if (s == 1.0) return x;
  if (dt == GS_FLOAT64) return x * s;
  return round_dt(dt, (double)((float)x * (float)s));
}

/* ---- tensor lists -------------------------------------------------------- */

typedef struct list {
  int64_t n;
  int64_t *counts, *offset; /* offset: flat element index of tensor i */
  gs_dtype_t *dts;
  int64_t total;
  gs_tensor_t *in, *out;
  char *in_slab, *out_slab;
} list_t;

/* Allocates in and out tensors. slab: all tensors of the list back to back in
 * one allocation (the library reduces them where they are); otherwise one
 * allocation each (and NULL data for some empty tensors). Bit 0 of slab is
 * for the inputs, bit 1 for the outputs; 1 means both. */
enum { SLAB_NONE = 0, SLAB_BOTH = 1, SLAB_IN_ONLY = 2, SLAB_OUT_ONLY = 3 };
static void list_make(list_t *L, int64_t n, const int64_t *counts, const gs_dtype_t *dts,
                      int slab) {
  int in_slab = slab == SLAB_BOTH || slab == SLAB_IN_ONLY;
  int out_slab = slab == SLAB_BOTH || slab == SLAB_OUT_ONLY;
  memset(L, 0, sizeof *L);
  L->n = n;
  L->counts = malloc(sizeof(int64_t) * (size_t)(n + 1));
  L->offset = malloc(sizeof(int64_t) * (size_t)(n + 1));
  L->dts = malloc(sizeof(gs_dtype_t) * (size_t)(n + 1));
  L->in = calloc((size_t)n + 1, sizeof(gs_tensor_t));
  L->out = calloc((size_t)n + 1, sizeof(gs_tensor_t));
  size_t bytes = 0;
  for (int64_t i = 0; i < n; i++) {
    L->counts[i] = counts[i];
    L->dts[i] = dts[i];
    L->offset[i] = L->total;
    L->total += counts[i];
    bytes += (size_t)counts[i] * gs_dtype_size(dts[i]);
  }
  if (in_slab) L->in_slab = malloc(bytes + 1);
  if (out_slab) L->out_slab = malloc(bytes + 1);
  size_t at = 0;
  for (int64_t i = 0; i < n; i++) {
    size_t b = (size_t)counts[i] * gs_dtype_size(dts[i]);
    int none = counts[i] == 0 && i % 2 == 0; /* NULL data: allowed for empty tensors */
    void *pi = in_slab ? L->in_slab + at : none ? NULL : malloc(b + 1);
    void *po = out_slab ? L->out_slab + at : none ? NULL : malloc(b + 1);
    at += b;
    L->in[i] = GS_HOST_TENSOR(pi, counts[i], dts[i]);
    L->out[i] = GS_HOST_TENSOR(po, counts[i], dts[i]);
  }
}

static void list_free(list_t *L) {
  for (int64_t i = 0; i < L->n; i++) {
    if (!L->in_slab) free(L->in[i].data);
    if (!L->out_slab) free(L->out[i].data);
  }
  free(L->in_slab);
  free(L->out_slab);
  free(L->counts);
  free(L->offset);
  free(L->dts);
  free(L->in);
  free(L->out);
}

/* Fills t (laid out like L) with rank r's values of stream `seed`. */
static void list_fill(const list_t *L, const gs_tensor_t *t, uint64_t seed, int r, int kind) {
  gs_rng_t rng = gs_rng_make(seed, r);
  for (int64_t i = 0; i < L->n; i++)
    for (int64_t e = 0; e < L->counts[i]; e++)
      put(L->dts[i], t[i].data, e, draw(&rng, L->dts[i], kind));
}

static void list_garbage(const list_t *L, const gs_tensor_t *t) {
  for (int64_t i = 0; i < L->n; i++)
    if (t[i].count) memset(t[i].data, 0xa5, (size_t)t[i].count * gs_dtype_size(L->dts[i]));
}

static uint64_t list_hash(const list_t *L, const gs_tensor_t *t) {
  uint64_t h = 0;
  for (int64_t i = 0; i < L->n; i++)
    if (t[i].count) h = gs_hash_bytes(h, t[i].data, (size_t)t[i].count * gs_dtype_size(L->dts[i]));
  return h;
}

/* ---- the allreduce reference --------------------------------------------- */

typedef struct ref {
  double *val, *tol;
} ref_t;

/* Reference over every rank's stream: val = the result rounded to the dtype,
 * tol = the allowed distance (0 = exact). */
static ref_t reference(const list_t *L, uint64_t seed, int kind, gs_op_t op, double pre,
                       double post, int exact) {
  ref_t R;
  int64_t T = L->total;
  R.val = malloc(sizeof(double) * (size_t)(T + 1));
  R.tol = malloc(sizeof(double) * (size_t)(T + 1));
  double *absum = calloc((size_t)T + 1, sizeof(double));
  for (int r = 0; r < size_; r++) {
    gs_rng_t rng = gs_rng_make(seed, r);
    for (int64_t i = 0; i < L->n; i++) {
      gs_dtype_t dt = L->dts[i];
      for (int64_t e = 0; e < L->counts[i]; e++) {
        int64_t k = L->offset[i] + e;
        double x = scale_dt(dt, draw(&rng, dt, kind), pre); /* packed */
        double *v = &R.val[k];
        if (r == 0) *v = x;
        else if (op == GS_OP_SUM || op == GS_OP_AVERAGE) *v += x;
        else if (op == GS_OP_MIN) *v = x < *v ? x : *v;
        else if (op == GS_OP_MAX) *v = x > *v ? x : *v;
        else *v *= x;
        absum[k] += fabs(x);
      }
    }
  }
  double post_eff = op == GS_OP_AVERAGE ? post * (1.0 / size_) : post;
  for (int64_t i = 0; i < L->n; i++) {
    gs_dtype_t dt = L->dts[i];
    double u = unit_roundoff(dt);
    for (int64_t e = 0; e < L->counts[i]; e++) {
      int64_t k = L->offset[i] + e;
      double v = scale_dt(dt, round_dt(dt, R.val[k]), post_eff);
      R.val[k] = v;
      R.tol[k] = 0;
      if (!exact && is_float(dt) && (op == GS_OP_SUM || op == GS_OP_AVERAGE))
        /* one rounding per reduction step, one for the scale */
        R.tol[k] = (size_ + 1) * u * absum[k] * fabs(post_eff) + 2 * u * fabs(v) +
                   (dt == GS_FLOAT16 ? size_ * 0x1p-24 : 0);
    }
  }
  free(absum);
  return R;
}

static void ref_free(ref_t *R) {
  free(R->val);
  free(R->tol);
}

/* Compares t with the reference; returns the number of wrong elements. */
static int64_t compare(const list_t *L, const gs_tensor_t *t, const ref_t *R, const char *what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < L->n; i++)
    for (int64_t e = 0; e < L->counts[i]; e++) {
      int64_t k = L->offset[i] + e;
      double g = get(L->dts[i], t[i].data, e);
      int ok = R->tol[k] == 0 ? g == R->val[k] : fabs(g - R->val[k]) <= R->tol[k];
      if (!ok && bad++ < 3)
        CHECK(0,
              "%s: tensor %lld (%s, %lld elements) element %lld: got %.17g, expected %.17g "
              "(tolerance %g)",
              what, (long long)i, gs_dtype_name(L->dts[i]), (long long)L->counts[i], (long long)e,
              g, R->val[k], R->tol[k]);
    }
  CHECK(bad == 0, "%s: %lld wrong elements", what, (long long)bad);
  return bad;
}

/* Cross-rank identity: each checked result's hash is recorded and all are
 * compared in one collective at the end of a group. */
#define MAX_HASHES 4096
static uint64_t hashes[MAX_HASHES];
static char hash_what[MAX_HASHES][256];
static int nhashes;

static void record_hash(uint64_t h, const char *what) {
  if (nhashes < MAX_HASHES) {
    hashes[nhashes] = h;
    snprintf(hash_what[nhashes], sizeof hash_what[0], "%.250s", what);
    nhashes++;
  }
}

static void check_hashes(void) {
  int n = nhashes;
  uint64_t *mm = calloc(2 * (size_t)n + 2, sizeof(uint64_t));
  uint64_t *r = calloc(2 * (size_t)n + 2, sizeof(uint64_t));
  for (int i = 0; i < n; i++) {
    mm[2 * i] = hashes[i];
    mm[2 * i + 1] = ~hashes[i];
  }
  MPI_Allreduce(mm, r, 2 * n, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  int bad = 0;
  for (int i = 0; i < n; i++)
    if ((r[2 * i] != hashes[i] || r[2 * i + 1] != ~hashes[i]) && bad++ < 5)
      CHECK(0, "result not bitwise identical across ranks: %s", hash_what[i]);
  CHECK(bad == 0, "%d results differ across ranks", bad);
  free(mm);
  free(r);
  nhashes = 0;
}

/* ---- allreduce ----------------------------------------------------------- */

/* Runs one allreduce over L in each mode of `modes` (bit 0: in place with
 * out = NULL, bit 1: in place with out == in, bit 2: out of place) and checks
 * it against R. */
enum { M_NULL = 1, M_SAME = 2, M_OUT = 4, M_ALL = 7 };
static void run_allreduce_modes(const list_t *L, uint64_t seed, int kind, gs_op_t op, double pre,
                                double post, const ref_t *R, const char *label, int modes) {
  static const char *const mode_name[3] = {"in place (out NULL)", "in place (out == in)",
                                           "out of place"};
  for (int mode = 0; mode < 3; mode++) {
    if (!(modes & (1 << mode))) continue;
    char what[200];
    snprintf(what, sizeof what, "%.150s, %s", label, mode_name[mode]);
    list_fill(L, L->in, seed, rank_, kind);
    const gs_tensor_t *out = mode == 0 ? NULL : mode == 1 ? L->in : L->out;
    uint64_t in_hash = list_hash(L, L->in);
    if (mode == 2) list_garbage(L, L->out);
    GS_OK(gs_allreduce(comm, L->in, out, L->n, op, pre, post));
    const gs_tensor_t *res = mode == 2 ? L->out : L->in;
    compare(L, res, R, what);
    record_hash(list_hash(L, res), what);
    if (mode == 2) CHECK(list_hash(L, L->in) == in_hash, "%s: the input changed", what);
  }
}

static void make_sizes(int64_t *counts, int64_t n, uint64_t seed, int64_t maxc) {
  gs_rng_t rng = gs_rng_make(seed, -1);
  for (int64_t i = 0; i < n; i++) {
    switch (i % 11) {
      case 0: counts[i] = 0; break;
      case 1: counts[i] = 1; break;
      default: counts[i] = gs_rng_int(&rng, 2, maxc) | 1; break; /* odd */
      case 5: counts[i] = gs_rng_int(&rng, 2, maxc); break;
    }
  }
}

/* n sizes as make_sizes gives them, each with a dtype drawn from all 8. */
static void make_mixed(int64_t *counts, gs_dtype_t *dts, int64_t n, uint64_t seed, int64_t maxc) {
  make_sizes(counts, n, seed, maxc);
  gs_rng_t rng = gs_rng_make(seed + 1, -1);
  for (int64_t i = 0; i < n; i++) dts[i] = all_dtypes[gs_rng_int(&rng, 0, NDT - 1)];
}

enum { L_ONE, L_MANY, L_MANY_SLAB, L_THRESHOLD, L_SMALL, NLAYOUTS };
static const char *const layout_name[NLAYOUTS] = {
    "one tensor", "200 tensors", "200 tensors back to back", "small threshold, big tensors",
    "3 tensors, at most 248 bytes"};

/* The small threshold is 600 elements' worth of bytes of the dtype: the
 * threshold list goes out in a handful of messages, two tensors alone. */
#define SMALL_THRESHOLD_ELEMS 600
static void layout_counts(int layout, int64_t *counts, int64_t *n) {
  switch (layout) {
    case L_ONE:
      *n = 1;
      counts[0] = 1037;
      break;
    case L_MANY:
    case L_MANY_SLAB:
      *n = 200;
      make_sizes(counts, 200, 11, 40);
      break;
    case L_THRESHOLD:
      *n = 16;
      make_sizes(counts, 16, 12, 100);
      counts[5] = 1503;                       /* far over the threshold */
      counts[10] = SMALL_THRESHOLD_ELEMS + 1; /* just over it */
      counts[11] = SMALL_THRESHOLD_ELEMS;     /* exactly at it: shares with nothing */
      break;
    case L_SMALL: /* small enough to travel with the validation message */
      *n = 3;
      counts[0] = 10;
      counts[1] = 0;
      counts[2] = 21;
      break;
  }
}

static void test_allreduce_matrix(void) {
  int64_t counts[256], n = 0;
  gs_dtype_t dts[256];
  int64_t default_threshold = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &default_threshold));
  for (int d = 0; d < NDT; d++) {
    gs_dtype_t dt = all_dtypes[d];
    for (int layout = 0; layout < NLAYOUTS; layout++) {
      layout_counts(layout, counts, &n);
      for (int64_t i = 0; i < n; i++) dts[i] = dt;
      list_t L;
      list_make(&L, n, counts, dts, layout == L_MANY_SLAB);
      GS_OK(gs_comm_set_fusion_threshold(
          comm, layout == L_THRESHOLD ? SMALL_THRESHOLD_ELEMS * (int64_t)gs_dtype_size(dt)
                                      : default_threshold));
      for (int o = 0; o < 5; o++) {
        gs_op_t op = reduce_ops[o];
        if (op == GS_OP_AVERAGE && !is_float(dt)) continue; /* GS_ERR_TYPE: test_errors */
        /* Every op on the 200-tensor list and on the small list (reduced by
         * gradsync's own kernels); two ops (rotating with the dtype) on the
         * one-tensor and back-to-back layouts and one on the threshold
         * layout, whose code paths do not depend on the op. */
        int o1 = (d + layout) % 5, o2 = (d + layout + 2) % 5;
        if (!is_float(dt) && o1 == 1) o1 = 0;
        if (!is_float(dt) && o2 == 1) o2 = 0;
        if (layout == L_THRESHOLD) o2 = o1;
        if (layout != L_MANY && layout != L_SMALL && o != o1 && o != o2) continue;
        SECTION("allreduce %s %s, %s", gs_op_name(op), gs_dtype_name(dt), layout_name[layout]);
        int kind = op == GS_OP_PROD ? K_PROD : K_RANDOM;
        uint64_t seed = 1000 + (uint64_t)(d * 100 + layout * 10 + o);
        ref_t R = reference(&L, seed, kind, op, 1.0, 1.0, 0);
        char label[160];
        snprintf(label, sizeof label, "%s %s, %s", gs_op_name(op), gs_dtype_name(dt),
                 layout_name[layout]);
        /* one mode per call, rotating: every (dtype, layout) sees all
         * three modes, and every op sees all three over the layouts */
        run_allreduce_modes(&L, seed, kind, op, 1.0, 1.0, &R, label, 1 << ((o + layout + d) % 3));
        ref_free(&R);
      }
      list_free(&L);
    }
  }
  GS_OK(gs_comm_set_fusion_threshold(comm, default_threshold));
}

/* Exact sums (dyadic values) with prescale/postscale and average: the
 * contract's rounding steps reproduced bit for bit. Inputs and outputs each
 * separate or back to back (where prescale is applied into the output). */
static void test_allreduce_scales(void) {
  /* {op is average, prescale, postscale} */
  static const double scales[][3] = {
      {0, 0.5, 2.5}, {1, 1.0, 1.0}, {1, -2.0, 0.25}, {0, -2.0, 0.25}};
  static const char *const slab_name[4] = {"separate", "back to back", "inputs back to back",
                                           "outputs back to back"};
  int64_t counts[256], n;
  gs_dtype_t dts[256];
  for (int d = 0; d < 4; d++) {
    gs_dtype_t dt = all_dtypes[d];
    for (int slab = 0; slab < 4; slab++) {
      if ((slab + d) % 2) continue;
      int layout = L_MANY;
      layout_counts(layout, counts, &n);
      for (int64_t i = 0; i < n; i++) dts[i] = dt;
      list_t L;
      list_make(&L, n, counts, dts, slab);
      for (int s = 0; s < 4; s++) {
        int avg = scales[s][0] != 0;
        gs_op_t op = avg ? GS_OP_AVERAGE : GS_OP_SUM;
        double pre = scales[s][1], post = scales[s][2];
        SECTION("allreduce %s %s prescale %g postscale %g, %s", gs_op_name(op), gs_dtype_name(dt),
                pre, post, slab_name[slab]);
        uint64_t seed = 5000 + (uint64_t)(d * 100 + slab * 10 + s * 2 + avg);
        ref_t R = reference(&L, seed, K_DYADIC, op, pre, post, 1);
        char label[160];
        snprintf(label, sizeof label, "%s %s pre %g post %g, %s", gs_op_name(op), gs_dtype_name(dt),
                 pre, post, slab_name[slab]);
        /* with one side back to back, out of place is the interesting mode */
        int modes = slab >= SLAB_IN_ONLY ? M_OUT : 1 << ((s * 2 + avg + d) % 3);
        run_allreduce_modes(&L, seed, K_DYADIC, op, pre, post, &R, label, modes);
        ref_free(&R);
      }
      list_free(&L);
    }
  }
}

/* One list mixing all 8 dtypes (grouped by dtype, order kept), with the
 * default threshold and a small one. Also: the same call twice gives the
 * same bits (run-to-run determinism), and n == 0 is a no-op. */
static void test_allreduce_mixed(void) {
  int64_t counts[200];
  gs_dtype_t dts[200];
  make_mixed(counts, dts, 200, 21, 40);
  counts[100] = 3001; /* over the small threshold as float64/int64 */
  int64_t default_threshold = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &default_threshold));
  for (int slab = 0; slab < 2; slab++)
    for (int small = 0; small < 2; small++) {
      if (slab && small) continue;
      list_t L;
      list_make(&L, 200, counts, dts, slab);
      GS_OK(gs_comm_set_fusion_threshold(comm, small ? 16384 : default_threshold));
      for (int o = 0; o < 5; o++) {
        gs_op_t op = reduce_ops[o];
        if (op == GS_OP_AVERAGE || (small && op != GS_OP_SUM)) continue;
        int kind = op == GS_OP_PROD ? K_PROD : K_RANDOM;
        SECTION("allreduce %s, 200 tensors of mixed dtypes%s%s", gs_op_name(op),
                slab ? ", back to back" : "", small ? ", threshold 16384 B" : "");
        uint64_t seed = 7000 + (uint64_t)(slab * 100 + small * 10 + o);
        ref_t R = reference(&L, seed, kind, op, 1.0, 1.0, 0);
        run_allreduce_modes(&L, seed, kind, op, 1.0, 1.0, &R, gs_test_section_,
                            small ? M_OUT : 1 << ((o + slab) % 3));
        ref_free(&R);
      }
      /* determinism: the same float sums twice give the same bits */
      if (slab || small) {
        list_free(&L);
        continue;
      }
      SECTION("allreduce determinism, mixed dtypes%s%s", slab ? ", back to back" : "",
              small ? ", threshold 16384 B" : "");
      list_fill(&L, L.in, 7999, rank_, K_RANDOM);
      GS_OK(gs_allreduce(comm, L.in, L.out, 200, GS_OP_SUM, 1.0, 1.0));
      uint64_t h1 = list_hash(&L, L.out);
      list_garbage(&L, L.out);
      GS_OK(gs_allreduce(comm, L.in, L.out, 200, GS_OP_SUM, 1.0, 1.0));
      CHECK(list_hash(&L, L.out) == h1, "a repeated call gave different bits");
      list_free(&L);
    }
  SECTION("allreduce with a 1-byte threshold: every tensor alone");
  {
    int64_t c8[8] = {0, 3, 1, 0, 17, 2, 0, 5};
    gs_dtype_t d8[8] = {GS_INT8, GS_FLOAT16, GS_INT8, GS_FLOAT32,
                        GS_INT8, GS_FLOAT16, GS_INT8, GS_INT64};
    list_t L;
    list_make(&L, 8, c8, d8, SLAB_NONE);
    GS_OK(gs_comm_set_fusion_threshold(comm, 1));
    ref_t R = reference(&L, 7100, K_RANDOM, GS_OP_MAX, 1.0, 1.0, 0);
    run_allreduce_modes(&L, 7100, K_RANDOM, GS_OP_MAX, 1.0, 1.0, &R, gs_test_section_, M_OUT);
    ref_free(&R);
    list_free(&L);
  }
  GS_OK(gs_comm_set_fusion_threshold(comm, default_threshold));
  SECTION("allreduce of an empty list");
  GS_OK(gs_allreduce(comm, NULL, NULL, 0, GS_OP_SUM, 1.0, 1.0));
  gs_tensor_t empty = GS_HOST_TENSOR(NULL, 0, GS_FLOAT32);
  GS_OK(gs_allreduce(comm, &empty, NULL, 1, GS_OP_MAX, 1.0, 1.0));
}

/* NaN anywhere gives NaN for sum, min and max (docs/decisions/fusion.md), on the
 * small path (gradsync's kernel inside the validation message) and the
 * regular one. Element e holds NaN on rank e % (size + 2) (elements where
 * that is >= size hold none), and element 1 holds NaN on every rank. */
static void test_allreduce_nan(void) {
  static const gs_op_t ops[3] = {GS_OP_SUM, GS_OP_MIN, GS_OP_MAX};
  for (int d = 0; d < 4; d++) {
    gs_dtype_t dt = all_dtypes[d];
    for (int big = 0; big < 2; big++) {
      int64_t n = big ? 1000 : 24;
      size_t es = gs_dtype_size(dt);
      char *buf = malloc((size_t)n * es);
      for (int o = 0; o < 3; o++) {
        SECTION("NaN propagation: %s %s, %lld elements", gs_op_name(ops[o]), gs_dtype_name(dt),
                (long long)n);
        for (int64_t e = 0; e < n; e++) {
          int nan_here = e % (size_ + 2) == rank_ || e == 1;
          put(dt, buf, e, nan_here ? NAN : (double)(rank_ + 1) * (e % 2 ? 1 : -1));
        }
        gs_tensor_t t = GS_HOST_TENSOR(buf, n, dt);
        GS_OK(gs_allreduce(comm, &t, NULL, 1, ops[o], 1.0, 1.0));
        int64_t bad = 0;
        for (int64_t e = 0; e < n; e++) {
          int any_nan = e % (size_ + 2) < size_ || e == 1;
          double g = get(dt, buf, e), w;
          if (any_nan) w = NAN;
          else if (ops[o] == GS_OP_SUM) w = (e % 2 ? 1 : -1) * size_ * (size_ + 1) / 2.0;
          else if ((ops[o] == GS_OP_MIN) == (e % 2 == 1)) w = e % 2 ? 1 : -1;
          else w = (e % 2 ? 1 : -1) * (double)size_;
          int ok = any_nan ? isnan(g) : g == w;
          if (!ok && bad++ < 3) CHECK(0, "element %lld: got %g, expected %g", (long long)e, g, w);
        }
        CHECK(bad == 0, "%lld wrong elements", (long long)bad);
        record_hash(gs_hash_bytes(0, buf, (size_t)n * es), gs_test_section_);
      }
      free(buf);
    }
  }
}

/* Integer sums and products wrap (two's complement), as MPI's do, on the
 * small path and the regular one. */
static void test_allreduce_wrap(void) {
  for (int big = 0; big < 2; big++) {
    int64_t n = big ? 300 : 4;
    SECTION("integer wrap-around, %lld elements", (long long)n);
    int8_t *a = malloc((size_t)n);
    uint8_t *b = malloc((size_t)n);
    int32_t *c = malloc((size_t)n * 4);
    int64_t *d = malloc((size_t)n * 8);
    for (int64_t i = 0; i < n; i++) {
      a[i] = 100;
      b[i] = 16;
      c[i] = 1 << 30;
      d[i] = INT64_MAX / 2 + 1; /* 2^62 */
    }
    gs_tensor_t ta = GS_HOST_TENSOR(a, n, GS_INT8), tb = GS_HOST_TENSOR(b, n, GS_UINT8);
    gs_tensor_t tc = GS_HOST_TENSOR(c, n, GS_INT32), td = GS_HOST_TENSOR(d, n, GS_INT64);
    GS_OK(gs_allreduce(comm, &ta, NULL, 1, GS_OP_SUM, 1.0, 1.0));
    GS_OK(gs_allreduce(comm, &tb, NULL, 1, GS_OP_PROD, 1.0, 1.0));
    GS_OK(gs_allreduce(comm, &tc, NULL, 1, GS_OP_SUM, 1.0, 1.0));
    GS_OK(gs_allreduce(comm, &td, NULL, 1, GS_OP_SUM, 1.0, 1.0));
    uint8_t wa = (uint8_t)(100u * (unsigned)size_), wb = 1;
    for (int r = 0; r < size_; r++) wb = (uint8_t)(wb * 16u);
    uint32_t wc = (uint32_t)size_ << 30;
    uint64_t wd = (uint64_t)size_ << 62;
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
      if (((uint8_t)a[i] != wa || b[i] != wb || (uint32_t)c[i] != wc || (uint64_t)d[i] != wd) &&
          bad++ < 3)
        CHECK(0,
              "element %lld: int8 %d (want %d), uint8 %u (want %u), int32 %d (want %d), "
              "int64 %lld (want %lld)",
              (long long)i, a[i], (int8_t)wa, b[i], wb, c[i], (int32_t)wc, (long long)d[i],
              (long long)(int64_t)wd);
    CHECK(bad == 0, "%d wrong elements", bad);
    free(a);
    free(b);
    free(c);
    free(d);
  }
}

/* A fused message of over 1 MiB whose tensors are scattered in memory: the
 * library reduces it in the tensors' own memory (ring) at size > 1. */
static void test_allreduce_large_scattered(void) {
  static const struct {
    gs_dtype_t dt;
    gs_op_t op;
    double pre, post;
    int kind, modes;
  } cases[] = {
      {GS_FLOAT32, GS_OP_SUM, 1.0, 1.0, K_RANDOM, M_NULL},
      {GS_FLOAT16, GS_OP_AVERAGE, 0.5, 2.0, K_DYADIC, M_OUT},
      {GS_INT64, GS_OP_MAX, 1.0, 1.0, K_RANDOM, M_OUT},
      {GS_BFLOAT16, GS_OP_MIN, 1.0, 1.0, K_RANDOM, M_SAME},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    gs_dtype_t dt = cases[k].dt;
    int64_t per = ((int64_t)1 << 20) / (int64_t)gs_dtype_size(dt); /* elements in 1 MiB */
    int64_t counts[40];
    gs_dtype_t dts[40];
    int64_t total = 0;
    for (int i = 0; i < 40; i++) {
      counts[i] = i % 13 == 0 ? 0 : per / 30 + (i % 7) * 3 + 1;
      dts[i] = dt;
      total += counts[i];
    }
    list_t L;
    list_make(&L, 40, counts, dts, SLAB_NONE);
    SECTION("allreduce %s %s, 40 scattered tensors, %lld bytes", gs_op_name(cases[k].op),
            gs_dtype_name(dt), (long long)(total * (int64_t)gs_dtype_size(dt)));
    CHECK(total > per, "the message is over 1 MiB");
    uint64_t seed = 13000 + k;
    ref_t R = reference(&L, seed, cases[k].kind, cases[k].op, cases[k].pre, cases[k].post,
                        cases[k].kind == K_DYADIC);
    run_allreduce_modes(&L, seed, cases[k].kind, cases[k].op, cases[k].pre, cases[k].post, &R,
                        gs_test_section_, cases[k].modes);
    ref_free(&R);
    list_free(&L);
  }
}

/* ---- broadcast ----------------------------------------------------------- */

static void test_broadcast(void) {
  int64_t counts[200];
  gs_dtype_t dts[200];
  make_mixed(counts, dts, 120, 31, 100);
  counts[60] = 4099; /* alone under the small threshold */
  int64_t default_threshold = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &default_threshold));
  for (int slab = 0; slab < 2; slab++)
    for (int small = 0; small < 2; small++) {
      list_t L;
      list_make(&L, 120, counts, dts, slab);
      GS_OK(gs_comm_set_fusion_threshold(comm, small ? 8192 : default_threshold));
      for (int root = 0; root < size_; root++) {
        if (small && root != size_ - 1) continue; /* every root with the default */
        SECTION("broadcast from root %d, mixed dtypes%s%s", root, slab ? ", back to back" : "",
                small ? ", threshold 8192 B" : "");
        uint64_t seed = 8000 + (uint64_t)(slab * 1000 + small * 100 + root);
        if (rank_ == root) list_fill(&L, L.in, seed, rank_, K_RANDOM);
        else list_garbage(&L, L.in);
        GS_OK(gs_broadcast(comm, L.in, 120, root));
        /* expected: root's values, bit for bit */
        list_fill(&L, L.out, seed, root, K_RANDOM);
        int bad = 0;
        for (int i = 0; i < 120; i++)
          if (counts[i] &&
              memcmp(L.in[i].data, L.out[i].data, (size_t)counts[i] * gs_dtype_size(dts[i])) != 0 &&
              bad++ < 3)
            CHECK(0, "tensor %d (%s, %lld elements) differs from root's", i, gs_dtype_name(dts[i]),
                  (long long)counts[i]);
        CHECK(bad == 0, "%d tensors differ", bad);
        record_hash(list_hash(&L, L.in), gs_test_section_);
      }
      list_free(&L);
    }
  GS_OK(gs_comm_set_fusion_threshold(comm, default_threshold));
  SECTION("broadcast of one scalar and of an empty list");
  int64_t v = rank_ == size_ - 1 ? 424242 : -1;
  gs_tensor_t t = GS_HOST_TENSOR(&v, 1, GS_INT64);
  GS_OK(gs_broadcast(comm, &t, 1, size_ - 1));
  CHECK(v == 424242, "got %lld", (long long)v);
  GS_OK(gs_broadcast(comm, NULL, 0, 0));
}

/* ---- allgatherv ---------------------------------------------------------- */

static void test_allgather(void) {
  enum { N = 7 };
  static const gs_dtype_t dts[N] = {GS_FLOAT32, GS_INT8,     GS_FLOAT16, GS_FLOAT32,
                                    GS_INT64,   GS_BFLOAT16, GS_FLOAT32};
  static const int64_t row_elems[N] = {1, 3, 7, 2, 5, 1, 4};
  int64_t default_threshold = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &default_threshold));
  for (int variant = 0; variant < 3; variant++) {
    /* 0: default threshold; 1: small threshold; 2: without row_elems */
    SECTION("allgather_counts + allgatherv, %s", variant == 0   ? "default threshold"
                                                 : variant == 1 ? "threshold 64 B"
                                                                : "row_elems NULL");
    GS_OK(gs_comm_set_fusion_threshold(comm, variant == 1 ? 64 : default_threshold));
    /* rank r's rows of tensor i: differ by rank, 0 included */
    int64_t rows[64][N];
    for (int r = 0; r < size_; r++) {
      gs_rng_t rng = gs_rng_make(900 + (uint64_t)variant, r);
      for (int i = 0; i < N; i++) {
        rows[r][i] = gs_rng_int(&rng, 0, 9) + r * 3;
        if ((i + r) % 4 == 1) rows[r][i] = 0;
      }
    }
    void *in_data[N];
    gs_tensor_t in[N], out[N];
    int64_t total[N];
    for (int i = 0; i < N; i++) {
      int64_t c = rows[rank_][i] * row_elems[i];
      in_data[i] = malloc((size_t)c * gs_dtype_size(dts[i]) + 1);
      in[i] = GS_HOST_TENSOR(in_data[i], c, dts[i]);
      gs_rng_t rng = gs_rng_make(950 + (uint64_t)(variant * 10 + i), rank_);
      for (int64_t e = 0; e < c; e++) put(dts[i], in_data[i], e, draw(&rng, dts[i], K_RANDOM));
      total[i] = 0;
      for (int r = 0; r < size_; r++) total[i] += rows[r][i] * row_elems[i];
    }
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(size_ * N));
    for (int k = 0; k < size_ * N; k++) counts[k] = -7;
    GS_OK(gs_allgather_counts(comm, in, N, variant == 2 ? NULL : row_elems, counts));
    int bad = 0;
    for (int r = 0; r < size_; r++)
      for (int i = 0; i < N; i++)
        if (counts[r * N + i] != rows[r][i] * row_elems[i] && bad++ < 3)
          CHECK(0, "counts[%d * %d + %d] = %lld, expected %lld", r, N, i,
                (long long)counts[r * N + i], (long long)(rows[r][i] * row_elems[i]));
    CHECK(bad == 0, "%d counts wrong", bad);
    for (int r = 0; r < size_; r++) /* keep going with the true counts */
      for (int i = 0; i < N; i++) counts[r * N + i] = rows[r][i] * row_elems[i];
    for (int i = 0; i < N; i++) {
      out[i] =
          GS_HOST_TENSOR(malloc((size_t)total[i] * gs_dtype_size(dts[i]) + 1), total[i], dts[i]);
      memset(out[i].data, 0x5a, (size_t)total[i] * gs_dtype_size(dts[i]));
    }
    GS_OK(gs_allgatherv(comm, in, out, N, counts));
    bad = 0;
    uint64_t h = 0;
    for (int i = 0; i < N; i++) {
      size_t es = gs_dtype_size(dts[i]);
      char *expect = malloc((size_t)total[i] * es + 1), *p = expect;
      for (int r = 0; r < size_; r++) {
        gs_rng_t rng = gs_rng_make(950 + (uint64_t)(variant * 10 + i), r);
        int64_t c = rows[r][i] * row_elems[i];
        for (int64_t e = 0; e < c; e++) put(dts[i], p, e, draw(&rng, dts[i], K_RANDOM));
        p += (size_t)c * es;
      }
      if (total[i] && memcmp(expect, out[i].data, (size_t)total[i] * es) != 0 && bad++ < 3)
        CHECK(0, "gathered tensor %d (%s, %lld elements) is not the concatenation over ranks", i,
              gs_dtype_name(dts[i]), (long long)total[i]);
      if (total[i]) h = gs_hash_bytes(h, out[i].data, (size_t)total[i] * es);
      free(expect);
    }
    CHECK(bad == 0, "%d gathered tensors wrong", bad);
    record_hash(h, gs_test_section_);
    for (int i = 0; i < N; i++) {
      free(in_data[i]);
      free(out[i].data);
    }
    free(counts);
  }
  GS_OK(gs_comm_set_fusion_threshold(comm, default_threshold));
}

/* ---- reduce_scatter ------------------------------------------------------ */

static void test_block_range(void) {
  SECTION("gs_block_range");
  int64_t first = -1, count = -1;
  static const int64_t want_first[4] = {0, 3, 6, 8}, want_count[4] = {3, 3, 2, 2};
  for (int r = 0; r < 4; r++) {
    GS_OK(gs_block_range(10, 5, 4, r, &first, &count));
    CHECK(first == want_first[r] * 5 && count == want_count[r] * 5,
          "rows 10 x 5 over 4, rank %d: [%lld, +%lld)", r, (long long)first, (long long)count);
  }
  GS_OK(gs_block_range(2, 3, 4, 3, &first, &count));
  CHECK(first == 6 && count == 0, "rows 2 over 4, rank 3: [%lld, +%lld)", (long long)first,
        (long long)count);
  GS_OK(gs_block_range(0, 3, 2, 1, &first, &count));
  CHECK(first == 0 && count == 0, "");
  for (int64_t rows = 0; rows < 40; rows++)
    for (int p = 1; p <= 6; p++) {
      int64_t next = 0;
      for (int r = 0; r < p; r++) {
        GS_OK(gs_block_range(rows, 2, p, r, &first, &count));
        int64_t want = rows / p + (r < rows % p);
        if (first != next || count != want * 2)
          CHECK(0, "rows %lld over %d, rank %d: [%lld, +%lld)", (long long)rows, p, r,
                (long long)first, (long long)count);
        next = first + count;
      }
      if (next != rows * 2) CHECK(0, "rows %lld over %d: blocks do not cover", (long long)rows, p);
    }
  GS_EXPECT(gs_block_range(10, 1, 4, 4, &first, &count), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_block_range(10, 1, 0, 0, &first, &count), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_block_range(-1, 1, 4, 0, &first, &count), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_block_range(10, 1, 4, 0, NULL, &count), GS_ERR_INVALID_ARGUMENT);
}

static void test_reduce_scatter(void) {
  enum { N = 9 };
  int64_t default_threshold = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &default_threshold));
  /* rows deliberately not divisible by size; 0 and 1 rows included */
  const int64_t rows[N] = {(int64_t)size_ * 5 + 1,
                           (int64_t)size_ * 3 + size_ - 1,
                           0,
                           1,
                           7,
                           (int64_t)size_ * 2,
                           13,
                           3,
                           101};
  const int64_t row_elems[N] = {3, 1, 4, 5, 2, 1, 6, 1, 1};
  int64_t counts[N];
  for (int i = 0; i < N; i++) counts[i] = rows[i] * row_elems[i];
  for (int d = 0; d < NDT; d++) {
    gs_dtype_t dt = all_dtypes[d];
    gs_dtype_t dts[N];
    for (int i = 0; i < N; i++) dts[i] = dt;
    for (int variant = 0; variant < 4; variant++) {
      /* 0: fused list; 1: small threshold (single-tensor messages); 2: one
       * tensor, rows NULL; 3: fused list with prescale 0.5 / postscale 2 */
      int64_t n = variant == 2 ? 1 : N;
      if (variant == 3 && !is_float(dt)) continue;
      GS_OK(gs_comm_set_fusion_threshold(comm, variant == 1 ? 64 : default_threshold));
      int64_t cnt1[N];
      memcpy(cnt1, counts, sizeof cnt1);
      if (variant == 2) cnt1[0] = (int64_t)size_ * 7 + size_ / 2 + 1;
      list_t L; /* L.in: the full tensors; L.out unused */
      list_make(&L, n, cnt1, dts, 0);
      for (int o = 0; o < 5; o++) {
        gs_op_t op = reduce_ops[o];
        if (op == GS_OP_AVERAGE && !is_float(dt)) continue;
        /* every op on the fused list; one op (rotating) on the others */
        if (variant == 1 && o != d % 5 && !(o == 0 && d % 5 == 1 && !is_float(dt))) continue;
        if (variant == 2 && o != (d + 2) % 5 && !(o == 0 && (d + 2) % 5 == 1 && !is_float(dt)))
          continue;
        if (variant == 3 && op != (d % 2 ? GS_OP_AVERAGE : GS_OP_SUM)) continue;
        double pre = variant == 3 ? 0.5 : 1.0, post = variant == 3 ? 2.0 : 1.0;
        int kind = op == GS_OP_PROD ? K_PROD : variant == 3 ? K_DYADIC : K_RANDOM;
        SECTION("reduce_scatter %s %s, %s", gs_op_name(op), gs_dtype_name(dt),
                variant == 0   ? "fused"
                : variant == 1 ? "threshold 64 B"
                : variant == 2 ? "one tensor, rows NULL"
                               : "prescale 0.5 postscale 2");
        uint64_t seed = 9000 + (uint64_t)(d * 100 + variant * 10 + o);
        list_fill(&L, L.in, seed, rank_, kind);
        uint64_t in_hash = list_hash(&L, L.in);
        ref_t R = reference(&L, seed, kind, op, pre, post, variant == 3);
        gs_tensor_t out[N];
        int64_t first[N];
        for (int64_t i = 0; i < n; i++) {
          int64_t r_i = variant == 2 ? cnt1[0] : rows[i], re = variant == 2 ? 1 : row_elems[i];
          int64_t c = 0;
          GS_OK(gs_block_range(r_i, re, size_, rank_, &first[i], &c));
          out[i] = GS_HOST_TENSOR(malloc((size_t)c * gs_dtype_size(dt) + 1), c, dt);
          memset(out[i].data, 0xa5, (size_t)c * gs_dtype_size(dt));
        }
        GS_OK(gs_reduce_scatter(comm, L.in, out, n, variant == 2 ? NULL : rows, op, pre, post));
        int64_t bad = 0;
        uint64_t h = 0;
        for (int64_t i = 0; i < n; i++) {
          for (int64_t e = 0; e < out[i].count; e++) {
            int64_t k = L.offset[i] + first[i] + e;
            double g = get(dt, out[i].data, e);
            int ok = R.tol[k] == 0 ? g == R.val[k] : fabs(g - R.val[k]) <= R.tol[k];
            if (!ok && bad++ < 3)
              CHECK(0,
                    "tensor %lld (%lld rows) element %lld of this rank's block (global %lld):"
                    " got %.17g, expected %.17g",
                    (long long)i, (long long)(variant == 2 ? cnt1[0] : rows[i]), (long long)e,
                    (long long)(first[i] + e), g, R.val[k]);
          }
          if (out[i].count)
            h = gs_hash_bytes(h, out[i].data, (size_t)out[i].count * gs_dtype_size(dt));
          free(out[i].data);
        }
        CHECK(bad == 0, "%lld wrong elements", (long long)bad);
        CHECK(list_hash(&L, L.in) == in_hash, "the input changed");
        (void)h; /* each rank holds a different block: no cross-rank hash */
        ref_free(&R);
      }
      list_free(&L);
    }
  }
  GS_OK(gs_comm_set_fusion_threshold(comm, default_threshold));
}

/* ---- shards -------------------------------------------------------------- */

static void test_shard_layout(void) {
  SECTION("gs_shard_layout: ONNX Runtime's numbers");
  gs_shard_layout_t lay;
  int64_t off[8];
  int own[8];
  {
    const int64_t c[3] = {40, 24, 8};
    GS_OK(gs_shard_layout(c, 3, 2, &lay, off, own));
    CHECK(lay.total == 72 && lay.padded == 128 && lay.rank_count == 64,
          "total %lld padded %lld rank_count %lld", (long long)lay.total, (long long)lay.padded,
          (long long)lay.rank_count);
    CHECK(own[0] == 0 && own[1] == 0 && own[2] == 1, "owners %d %d %d", own[0], own[1], own[2]);
    CHECK(off[0] == 0 && off[1] == 40 && off[2] == 64, "offsets %lld %lld %lld", (long long)off[0],
          (long long)off[1], (long long)off[2]);
  }
  {
    const int64_t c[1] = {64};
    GS_OK(gs_shard_layout(c, 1, 2, &lay, NULL, NULL));
    CHECK(lay.padded == 128 && lay.rank_count == 64, "padded %lld (a full block is always added)",
          (long long)lay.padded);
  }
  {
    const int64_t c[2] = {60, 10};
    GS_EXPECT(gs_shard_layout(c, 2, 2, &lay, off, own), GS_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("a single rank must own the entire tensor");
  }
  {
    const int64_t c[5] = {64, 40, 24, 64, 30};
    GS_OK(gs_shard_layout(c, 5, 4, &lay, off, own));
    CHECK(lay.total == 222 && lay.padded == 256 && lay.rank_count == 64,
          "total %lld padded %lld rank_count %lld", (long long)lay.total, (long long)lay.padded,
          (long long)lay.rank_count);
    CHECK(own[0] == 0 && own[1] == 1 && own[2] == 1 && own[3] == 2 && own[4] == 3,
          "owners %d %d %d %d %d", own[0], own[1], own[2], own[3], own[4]);
  }
  {
    const int64_t c[1] = {0};
    GS_OK(gs_shard_layout(c, 1, 3, &lay, off, own));
    CHECK(lay.total == 0 && lay.padded == 96 && lay.rank_count == 32 && own[0] == 0, "");
    GS_OK(gs_shard_layout(NULL, 0, 1, &lay, NULL, NULL));
    CHECK(lay.padded == 32, "padded %lld", (long long)lay.padded);
  }
  /* random lists against an independent computation */
  SECTION("gs_shard_layout: random lists");
  gs_rng_t rng = gs_rng_make(61, -1);
  int bad = 0;
  for (int trial = 0; trial < 2000; trial++) {
    int size = (int)gs_rng_int(&rng, 1, 8);
    int64_t n = gs_rng_int(&rng, 1, 8), c[8];
    for (int64_t i = 0; i < n; i++) c[i] = gs_rng_int(&rng, 0, 80);
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += c[i];
    int64_t align = 32 * (int64_t)size, padded = (total / align + 1) * align, rc = padded / size;
    int valid = 1;
    int64_t o = 0, woff[8];
    int wown[8];
    for (int64_t i = 0; i < n; i++) {
      woff[i] = o;
      wown[i] = (int)(o / rc);
      if (o + c[i] > (wown[i] + 1) * rc) valid = 0;
      o += c[i];
    }
    gs_status_t s = gs_shard_layout(c, n, size, &lay, off, own);
    int ok = valid ? s == GS_SUCCESS && lay.total == total && lay.padded == padded &&
                         lay.rank_count == rc
                   : s == GS_ERR_INVALID_ARGUMENT;
    for (int64_t i = 0; ok && valid && i < n; i++) ok = off[i] == woff[i] && own[i] == wown[i];
    if (!ok && bad++ < 3)
      CHECK(0, "trial %d: size %d, %lld tensors: status %d, expected %s", trial, size, (long long)n,
            (int)s, valid ? "success" : "invalid argument");
  }
  CHECK(bad == 0, "%d random layouts wrong", bad);
}

/* A list that is a valid layout for this communicator's size. */
static int64_t shard_counts(int64_t *c) {
  switch (size_) {
    case 1:
      c[0] = 5;
      c[1] = 17;
      c[2] = 0;
      c[3] = 33;
      return 4;
    case 2:
      c[0] = 40;
      c[1] = 24;
      c[2] = 8;
      return 3;
    case 3: {
      static const int64_t k[7] = {40, 20, 4, 60, 4, 50, 10};
      memcpy(c, k, sizeof k);
      return 7;
    }
    case 4: {
      static const int64_t k[5] = {64, 40, 24, 64, 30};
      memcpy(c, k, sizeof k);
      return 5;
    }
    default: /* 2 tensors of 16 per rank: rank_count 64 */
      for (int i = 0; i < 2 * size_ && i < 64; i++) c[i] = 16;
      return 2 * size_ < 64 ? 2 * size_ : 64;
  }
}

static void shard_collectives(int small) {
  int64_t c[64];
  /* small: everything inside rank 0's range, the other ranks own nothing */
  int64_t n = small ? 3 : shard_counts(c);
  if (small) {
    c[0] = 8;
    c[1] = 0;
    c[2] = 5;
  }
  gs_shard_layout_t lay;
  int64_t off[64];
  int own[64];
  GS_OK(gs_shard_layout(c, n, size_, &lay, off, own));
  static const struct {
    gs_dtype_t dt;
    gs_op_t op;
    double pre, post;
  } cases[] = {
      {GS_FLOAT32, GS_OP_SUM, 1.0, 1.0},     {GS_INT32, GS_OP_SUM, 1.0, 1.0},
      {GS_INT64, GS_OP_MAX, 1.0, 1.0},       {GS_BFLOAT16, GS_OP_SUM, 1.0, 1.0},
      {GS_FLOAT16, GS_OP_AVERAGE, 1.0, 1.0}, {GS_FLOAT64, GS_OP_AVERAGE, 0.5, 3.0},
      {GS_UINT8, GS_OP_MIN, 1.0, 1.0},       {GS_FLOAT32, GS_OP_PROD, 1.0, 1.0},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    if (small && k % 3) continue;
    gs_dtype_t dt = cases[k].dt;
    gs_dtype_t dts[64];
    for (int64_t i = 0; i < n; i++) dts[i] = dt;
    list_t L;
    list_make(&L, n, c, dts, k % 2);
    int kind = cases[k].op == GS_OP_PROD ? K_PROD : K_DYADIC;
    uint64_t seed = 12000 + k + 50 * (uint64_t)small;

    SECTION("allgather_shards %s%s", gs_dtype_name(dt), small ? ", all on rank 0" : "");
    /* every rank fills only what it owns; the rest is garbage */
    list_fill(&L, L.out, seed, rank_, kind);
    list_garbage(&L, L.in);
    for (int64_t i = 0; i < n; i++)
      if (own[i] == rank_ && c[i])
        memcpy(L.in[i].data, L.out[i].data, (size_t)c[i] * gs_dtype_size(dt));
    GS_OK(gs_allgather_shards(comm, L.in, n));
    int bad = 0;
    for (int r = 0; r < size_; r++) {
      list_fill(&L, L.out, seed, r, kind);
      for (int64_t i = 0; i < n; i++)
        if (own[i] == r && c[i] &&
            memcmp(L.in[i].data, L.out[i].data, (size_t)c[i] * gs_dtype_size(dt)) && bad++ < 3)
          CHECK(0, "tensor %lld does not hold its owner's (rank %d) values", (long long)i, r);
    }
    CHECK(bad == 0, "%d tensors wrong", bad);
    record_hash(list_hash(&L, L.in), gs_test_section_);

    SECTION("reduce_scatter_shards %s %s pre %g post %g", gs_op_name(cases[k].op),
            gs_dtype_name(dt), cases[k].pre, cases[k].post);
    list_fill(&L, L.in, seed + 100, rank_, kind);
    list_fill(&L, L.out, seed + 100, rank_, kind); /* a copy of the input */
    ref_t R = reference(&L, seed + 100, kind, cases[k].op, cases[k].pre, cases[k].post, 1);
    GS_OK(gs_reduce_scatter_shards(comm, L.in, n, cases[k].op, cases[k].pre, cases[k].post));
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
      if (own[i] != rank_) {
        if (c[i] && memcmp(L.in[i].data, L.out[i].data, (size_t)c[i] * gs_dtype_size(dt)) &&
            wrong++ < 3)
          CHECK(0, "tensor %lld is owned by rank %d but changed here", (long long)i, own[i]);
        continue;
      }
      for (int64_t e = 0; e < c[i]; e++) {
        double g = get(dt, L.in[i].data, e), w = R.val[L.offset[i] + e];
        if (g != w && wrong++ < 3)
          CHECK(0, "owned tensor %lld element %lld: got %.17g, expected %.17g", (long long)i,
                (long long)e, g, w);
      }
    }
    CHECK(wrong == 0, "%lld wrong elements", (long long)wrong);
    ref_free(&R);
    list_free(&L);
  }
}

static void test_shard_collectives(void) {
  shard_collectives(0);
  shard_collectives(1);
}

/* ---- communicator basics ------------------------------------------------- */

static void test_comm_basics(void) {
  SECTION("communicator accessors");
  int r = -1, s = -1, lr = -1, ls = -1, chk = -1;
  GS_OK(gs_comm_rank(comm, &r));
  GS_OK(gs_comm_size(comm, &s));
  GS_OK(gs_comm_local_rank(comm, &lr));
  GS_OK(gs_comm_local_size(comm, &ls));
  GS_OK(gs_comm_check_enabled(comm, &chk));
  CHECK(r == rank_ && s == size_, "rank %d size %d", r, s);
  CHECK(ls >= 1 && ls <= size_ && lr >= 0 && lr < ls, "local rank %d of %d", lr, ls);
  CHECK(chk == 1, "validation is on by default");
  MPI_Comm m;
  GS_OK(gs_comm_mpi(comm, &m));
  int cmp = -1;
  MPI_Comm_compare(m, MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT, "gs_comm_mpi is a duplicate of MPI_COMM_WORLD (%d)", cmp);
  GS_OK(gs_barrier(comm));

  SECTION("gs_comm_split into even and odd ranks");
  gs_comm_t sub = NULL;
  int64_t parent_th = 0, sub_th = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &parent_th));
  GS_OK(gs_comm_set_fusion_threshold(comm, 77777));
  GS_OK(gs_comm_split(comm, rank_ % 2, -rank_, &sub)); /* key -rank: reversed order */
  GS_OK(gs_comm_set_fusion_threshold(comm, parent_th));
  GS_OK(gs_comm_fusion_threshold(sub, &sub_th));
  CHECK(sub_th == 77777, "the new communicator inherits the threshold: %lld", (long long)sub_th);
  int sr = -1, ss = -1;
  GS_OK(gs_comm_rank(sub, &sr));
  GS_OK(gs_comm_size(sub, &ss));
  int want_size = (size_ + 1 - rank_ % 2) / 2;
  CHECK(ss == want_size, "size %d, expected %d", ss, want_size);
  int higher = 0; /* ranks of my color above me come first */
  for (int q = rank_ + 1; q < size_; q++) higher += q % 2 == rank_ % 2;
  CHECK(sr == higher, "rank %d, expected %d", sr, higher);
  int64_t v = rank_;
  gs_tensor_t t = GS_HOST_TENSOR(&v, 1, GS_INT64);
  GS_OK(gs_allreduce(sub, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  int64_t want = 0;
  for (int q = rank_ % 2; q < size_; q += 2) want += q;
  CHECK(v == want, "sum over my color %lld, expected %lld", (long long)v, (long long)want);
  GS_OK(gs_comm_free(&sub));
  CHECK(sub == NULL);
  gs_comm_t none = (gs_comm_t)1;
  GS_OK(gs_comm_split(comm, rank_ == 0 ? -1 : 0, 0, &none));
  if (rank_ == 0) CHECK(none == NULL, "color < 0 gives NULL");
  else CHECK(none != NULL);
  GS_OK(gs_comm_free(&none));

  SECTION("version and info");
  CHECK(strcmp(gs_version(), GS_VERSION_STRING) == 0, "%s", gs_version());
  CHECK(gs_mpi_library_version()[0] != '\0');
  CHECK(gs_default_fusion_threshold() > 0);
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.fusion_threshold = 12345;
  cfg.check = 0;
  gs_comm_t c2 = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &c2));
  int64_t th = 0;
  GS_OK(gs_comm_fusion_threshold(c2, &th));
  CHECK(th == 12345, "configured threshold %lld", (long long)th);
  GS_OK(gs_comm_check_enabled(c2, &chk));
  CHECK(chk == 0, "configured check");
  /* with validation off the collectives still work */
  float f = 1.0f;
  gs_tensor_t ft = GS_HOST_TENSOR(&f, 1, GS_FLOAT32);
  GS_OK(gs_allreduce(c2, &ft, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  CHECK(f == (float)size_, "%g", (double)f);
  GS_OK(gs_comm_free(&c2));
}

/* GS_TEST_TIMES=1 prints each group's time on rank 0. */
#define RUN(fn)                                                     \
  do {                                                              \
    double t0_ = MPI_Wtime();                                       \
    fn();                                                           \
    if (rank_ == 0 && getenv("GS_TEST_TIMES"))                      \
      fprintf(stderr, "  %-24s %6.2f s\n", #fn, MPI_Wtime() - t0_); \
  } while (0)

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_collectives");
  rank_ = gs_test_rank();
  size_ = gs_test_size();
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));
  RUN(test_comm_basics);
  RUN(test_allreduce_matrix);
  RUN(test_allreduce_scales);
  RUN(test_allreduce_mixed);
  RUN(test_allreduce_nan);
  RUN(test_allreduce_wrap);
  RUN(test_allreduce_large_scattered);
  RUN(test_broadcast);
  RUN(test_allgather);
  RUN(test_block_range);
  RUN(test_reduce_scatter);
  RUN(test_shard_layout);
  RUN(test_shard_collectives);
  check_hashes(); /* every recorded result, bitwise, across ranks */
  GS_OK(gs_comm_free(&comm));
  return gs_test_finish();
}
