/* Every collective and kernel on CUDA memory against the same call on host
 * memory, with the same inputs. With GRADSYNC_NCCL=0 (the first
 * communicator here) device data takes MPI through pinned host memory, and
 * the device pack/unpack/scale kernels share the host's arithmetic, so the
 * results must be bitwise equal. A second communicator takes NCCL when it is
 * usable (one GPU per rank); its floating results are compared within the
 * dtype's tolerance, since NCCL's reduction order is its own.
 *
 * Skips (passes) when no CUDA device is visible. Under
 * build/emulated/libgradsync.so (make test-emulated) the "device" is host
 * memory behind an emulated runtime, which exercises all of the plumbing. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

#define NSIZES 6
static const int64_t SIZES[NSIZES] = {0, 1, 17, 1000, 4099, 20000};
static const gs_dtype_t DTYPES[] = {GS_FLOAT32, GS_FLOAT16, GS_BFLOAT16, GS_FLOAT64, GS_INT32};
#define NDT ((int)(sizeof DTYPES / sizeof *DTYPES))

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static gs_device_t DEV = {GS_DEVICE_CUDA, 0};

typedef struct list {
  int64_t n;
  gs_tensor_t host[NSIZES * 5], dev[NSIZES * 5];
} list_t;

static void fill(gs_rng_t *r, gs_dtype_t dt, void *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = gs_rng_int(r, -40, 40) * 0.25; /* exact in every dtype */
    switch (dt) {
      case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
      case GS_FLOAT64: ((double *)p)[i] = v; break;
      case GS_INT32: ((int32_t *)p)[i] = (int32_t)(v * 4); break;
      case GS_FLOAT16: ((uint16_t *)p)[i] = gs_ref_double_to_f16(v); break;
      default: { /* bfloat16: the top half of the float's bits (v is exact) */
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
      }
    }
  }
}

/* A list mixing dtypes and sizes; the device copy holds the same bytes. */
static void make_list(list_t *l, uint64_t seed, int ndt, int float_only, int shift) {
  gs_rng_t r = gs_rng_make(seed, gs_test_rank());
  l->n = 0;
  for (int s = 0; s < NSIZES; s++)
    for (int d = 0; d < ndt; d++) {
      gs_dtype_t dt = DTYPES[d];
      if (float_only && dt == GS_INT32) continue;
      int64_t n = SIZES[(s + d + shift) % NSIZES];
      size_t bytes = (size_t)n * gs_dtype_size(dt);
      gs_tensor_t *h = &l->host[l->n], *v = &l->dev[l->n];
      void *hp = NULL, *dp = NULL;
      GS_OK(gs_malloc(HOST, bytes, &hp));
      GS_OK(gs_malloc(DEV, bytes, &dp));
      fill(&r, dt, hp, n);
      GS_OK(gs_memcpy(dp, DEV, hp, HOST, bytes));
      *h = (gs_tensor_t){hp, n, dt, HOST};
      *v = (gs_tensor_t){dp, n, dt, DEV};
      l->n++;
    }
}

static void free_list(list_t *l) {
  for (int64_t i = 0; i < l->n; i++) {
    gs_free(HOST, l->host[i].data);
    gs_free(DEV, l->dev[i].data);
  }
  l->n = 0;
}

static double tolerance(gs_dtype_t dt) {
  switch (dt) {
    case GS_FLOAT16: return 2e-2;
    case GS_BFLOAT16: return 2e-1;
    case GS_FLOAT32: return 1e-5;
    case GS_FLOAT64: return 1e-12;
    default: return 0.0;
  }
}

static double value(gs_dtype_t dt, const void *p, int64_t i) {
  switch (dt) {
    case GS_FLOAT32: return ((const float *)p)[i];
    case GS_FLOAT64: return ((const double *)p)[i];
    case GS_INT32: return ((const int32_t *)p)[i];
    case GS_FLOAT16: return gs_ref_f16_to_double(((const uint16_t *)p)[i]);
    default: return gs_ref_bf16_to_double(((const uint16_t *)p)[i]);
  }
}

/* Device tensor i (copied back) against host tensor i. */
static void compare(const gs_tensor_t *h, const gs_tensor_t *d, int64_t n, int exact,
                    const char *what) {
  for (int64_t i = 0; i < n; i++) {
    size_t bytes = (size_t)h[i].count * gs_dtype_size(h[i].dtype);
    void *back = malloc(bytes ? bytes : 1);
    GS_OK(gs_memcpy(back, HOST, d[i].data, DEV, bytes));
    if (exact) {
      CHECK(memcmp(back, h[i].data, bytes) == 0, "%s: tensor %lld (%s, %lld elements) differs",
            what, (long long)i, gs_dtype_name(h[i].dtype), (long long)h[i].count);
    } else {
      int64_t bad = -1;
      for (int64_t k = 0; k < h[i].count && bad < 0; k++) {
        double a = value(h[i].dtype, h[i].data, k), b = value(h[i].dtype, back, k);
        if (fabs(a - b) > tolerance(h[i].dtype) * (1.0 + fabs(a))) bad = k;
      }
      CHECK(bad < 0, "%s: tensor %lld (%s) element %lld differs", what, (long long)i,
            gs_dtype_name(h[i].dtype), (long long)bad);
    }
    free(back);
  }
}

/* Element i of rank r's input for the NaN/zero min-max test: a NaN (of
 * varying sign and payload) on one rank only at some positions, signed zeros
 * meeting at others, ordinary numbers elsewhere. */
static double minmax_input(int64_t i, int r) {
  switch (i % 6) {
    case 0: return r == (int)(i / 6) % gs_test_size() ? (i % 12 ? NAN : -NAN) : 1.5 * r;
    case 1: return r % 2 ? -0.0 : 0.0;
    case 2: return r == 0 ? -0.0 : 0.0;
    case 3: return -0.25 * (double)((r + i) % 5);
    case 4: return r == gs_test_size() - 1 ? NAN : -2.0;
    default: return (double)((r * 7 + i) % 11) - 5.0;
  }
}

static void store_value(gs_dtype_t dt, void *p, int64_t i, double v) {
  switch (dt) {
    case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
    case GS_FLOAT64: ((double *)p)[i] = v; break;
    case GS_FLOAT16: ((uint16_t *)p)[i] = gs_ref_double_to_f16(v); break;
    default: {
      float f = (float)v;
      uint32_t u;
      memcpy(&u, &f, 4);
      ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    }
  }
}

/* min/max give the same bits on every path: any NaN gives the canonical
 * quiet NaN, and -0 is below +0 (NCCL's fmin/fmax would drop the NaN). */
static void minmax_nan(gs_comm_t c) {
  static const gs_dtype_t fdt[] = {GS_FLOAT32, GS_FLOAT64, GS_FLOAT16, GS_BFLOAT16};
  const int64_t n = 601;
  for (int op = 0; op < 2; op++)
    for (int d = 0; d < 4; d++) {
      gs_dtype_t dt = fdt[d];
      SECTION("allreduce %s of %s with NaN and signed zeros", op ? "max" : "min",
              gs_dtype_name(dt));
      size_t es = gs_dtype_size(dt), bytes = (size_t)n * es;
      void *h = malloc(bytes), *want = malloc(bytes), *back = malloc(bytes), *dv = NULL;
      for (int64_t i = 0; i < n; i++) {
        store_value(dt, h, i, minmax_input(i, gs_test_rank()));
        double best = minmax_input(i, 0);
        int nan = isnan(best);
        for (int r = 1; r < gs_test_size(); r++) {
          double v = minmax_input(i, r);
          nan |= isnan(v);
          if (v == best) best = (signbit(v) != 0) == (op == 0) ? v : best;
          else if (op ? v > best : v < best) best = v;
        }
        store_value(dt, want, i, nan ? NAN : best);
        if (gs_test_size() == 1) { /* nothing is reduced: the input passes unchanged */
          memcpy((char *)want + (size_t)i * es, (char *)h + (size_t)i * es, es);
          continue;
        }
        if (nan && dt == GS_FLOAT16) ((uint16_t *)want)[i] = 0x7e00u;
        if (nan && dt == GS_BFLOAT16) ((uint16_t *)want)[i] = 0x7fc0u;
        if (nan && dt == GS_FLOAT32) ((uint32_t *)want)[i] = 0x7fc00000u;
        if (nan && dt == GS_FLOAT64) ((uint64_t *)want)[i] = 0x7ff8000000000000ull;
      }
      GS_OK(gs_malloc(DEV, bytes, &dv));
      GS_OK(gs_memcpy(dv, DEV, h, HOST, bytes));
      gs_tensor_t th = {h, n, dt, HOST}, td = {dv, n, dt, DEV};
      GS_OK(gs_allreduce(c, &th, NULL, 1, op ? GS_OP_MAX : GS_OP_MIN, 1.0, 1.0));
      GS_OK(gs_allreduce(c, &td, NULL, 1, op ? GS_OP_MAX : GS_OP_MIN, 1.0, 1.0));
      GS_OK(gs_memcpy(back, HOST, dv, DEV, bytes));
      CHECK(memcmp(h, want, bytes) == 0, "host %s: not the expected bits", gs_dtype_name(dt));
      CHECK(memcmp(back, want, bytes) == 0,
            "device %s: not the expected bits (a NaN dropped "
            "or a signed zero lost?)",
            gs_dtype_name(dt));
      gs_free(DEV, dv);
      free(h);
      free(want);
      free(back);
    }
}

static void allreduces(gs_comm_t c, int exact) {
  minmax_nan(c);
  static const gs_op_t ops[] = {GS_OP_SUM, GS_OP_AVERAGE, GS_OP_MIN, GS_OP_MAX};
  for (int k = 0; k < 4; k++) {
    int floats = ops[k] == GS_OP_AVERAGE;
    for (int out_of_place = 0; out_of_place < 2; out_of_place++) {
      SECTION("allreduce %s%s", gs_op_name(ops[k]), out_of_place ? " out of place" : "");
      list_t in, out;
      make_list(&in, 100 + k, NDT, floats, 0);
      make_list(&out, 200 + k, NDT, floats, 0);
      double pre = floats ? 0.5 : 1.0, post = floats ? 3.0 : 1.0;
      GS_OK(gs_allreduce(c, in.host, out_of_place ? out.host : NULL, in.n, ops[k], pre, post));
      GS_OK(gs_allreduce(c, in.dev, out_of_place ? out.dev : NULL, in.n, ops[k], pre, post));
      if (out_of_place) {
        compare(out.host, out.dev, out.n, exact, "allreduce output");
        compare(in.host, in.dev, in.n, 1, "allreduce input (must be unchanged)");
      } else {
        compare(in.host, in.dev, in.n, exact, "allreduce in place");
      }
      free_list(&in);
      free_list(&out);
    }
  }
  SECTION("adasum");
  list_t a;
  make_list(&a, 300, 4, 1, 0);
  GS_OK(gs_allreduce(c, a.host, NULL, a.n, GS_OP_ADASUM, 1.0, 1.0));
  GS_OK(gs_allreduce(c, a.dev, NULL, a.n, GS_OP_ADASUM, 1.0, 1.0));
  /* the device's dot products sum in their own order: not bitwise on a GPU */
  compare(a.host, a.dev, a.n, exact && strcmp(gs_cuda_archs(), "emulated") == 0, "adasum");
  free_list(&a);
  /* hierarchical: groups of two ranks where that makes a power-of-two count */
  int p = gs_test_size();
  if (p % 2 == 0 && ((p / 2) & (p / 2 - 1)) == 0) {
    SECTION("hierarchical adasum, groups of 2");
    setenv("GRADSYNC_HIERARCHY_SIZE", "2", 1);
    make_list(&a, 310, 4, 1, 0);
    GS_OK(gs_allreduce(c, a.host, NULL, a.n, GS_OP_ADASUM_HIERARCHICAL, 1.0, 1.0));
    GS_OK(gs_allreduce(c, a.dev, NULL, a.n, GS_OP_ADASUM_HIERARCHICAL, 1.0, 1.0));
    compare(a.host, a.dev, a.n, exact && strcmp(gs_cuda_archs(), "emulated") == 0,
            "hierarchical adasum");
    free_list(&a);
    unsetenv("GRADSYNC_HIERARCHY_SIZE");
  }
}

static void broadcasts_and_gathers(gs_comm_t c, int exact) {
  int p = gs_test_size(), me = gs_test_rank();
  SECTION("broadcast");
  list_t b;
  make_list(&b, 400, NDT, 0, 0);
  GS_OK(gs_broadcast(c, b.host, b.n, p - 1));
  GS_OK(gs_broadcast(c, b.dev, b.n, p - 1));
  compare(b.host, b.dev, b.n, 1, "broadcast");
  free_list(&b);

  SECTION("allgatherv");
  list_t in, out;
  make_list(&in, 500, 3, 0, me); /* sizes differ by rank */
  int64_t *counts = malloc((size_t)p * (size_t)in.n * sizeof *counts);
  GS_OK(gs_allgather_counts(c, in.host, in.n, NULL, counts));
  out.n = in.n;
  for (int64_t i = 0; i < in.n; i++) {
    int64_t total = 0;
    for (int r = 0; r < p; r++) total += counts[(size_t)r * in.n + i];
    size_t bytes = (size_t)total * gs_dtype_size(in.host[i].dtype);
    void *hp = NULL, *dp = NULL;
    GS_OK(gs_malloc(HOST, bytes, &hp));
    GS_OK(gs_malloc(DEV, bytes, &dp));
    out.host[i] = (gs_tensor_t){hp, total, in.host[i].dtype, HOST};
    out.dev[i] = (gs_tensor_t){dp, total, in.host[i].dtype, DEV};
  }
  GS_OK(gs_allgatherv(c, in.host, out.host, in.n, counts));
  GS_OK(gs_allgatherv(c, in.dev, out.dev, in.n, counts));
  compare(out.host, out.dev, out.n, 1, "allgatherv");
  free(counts);
  free_list(&in);
  free_list(&out);

  SECTION("reduce_scatter");
  list_t rs;
  make_list(&rs, 600, NDT, 1, 0);
  list_t ro = {0};
  for (int64_t i = 0; i < rs.n; i++) {
    int64_t first, cnt;
    gs_block_range(rs.host[i].count, 1, p, me, &first, &cnt);
    size_t bytes = (size_t)cnt * gs_dtype_size(rs.host[i].dtype);
    void *hp = NULL, *dp = NULL;
    GS_OK(gs_malloc(HOST, bytes, &hp));
    GS_OK(gs_malloc(DEV, bytes, &dp));
    ro.host[i] = (gs_tensor_t){hp, cnt, rs.host[i].dtype, HOST};
    ro.dev[i] = (gs_tensor_t){dp, cnt, rs.host[i].dtype, DEV};
    ro.n++;
  }
  GS_OK(gs_reduce_scatter(c, rs.host, ro.host, rs.n, NULL, GS_OP_AVERAGE, 2.0, 1.0));
  GS_OK(gs_reduce_scatter(c, rs.dev, ro.dev, rs.n, NULL, GS_OP_AVERAGE, 2.0, 1.0));
  compare(ro.host, ro.dev, ro.n, exact, "reduce_scatter");
  free_list(&rs);
  free_list(&ro);

  SECTION("shards");
  list_t sh;
  gs_rng_t r = gs_rng_make(700, 0); /* same sizes on every rank */
  sh.n = 0;
  for (int i = 0; i < 9; i++) {
    int64_t n = gs_rng_int(&r, 0, 300);
    void *hp = NULL, *dp = NULL;
    GS_OK(gs_malloc(HOST, (size_t)n * 4, &hp));
    GS_OK(gs_malloc(DEV, (size_t)n * 4, &dp));
    gs_rng_t data = gs_rng_make(701 + (uint64_t)i, me);
    fill(&data, GS_FLOAT32, hp, n);
    GS_OK(gs_memcpy(dp, DEV, hp, HOST, (size_t)n * 4));
    sh.host[i] = (gs_tensor_t){hp, n, GS_FLOAT32, HOST};
    sh.dev[i] = (gs_tensor_t){dp, n, GS_FLOAT32, DEV};
    sh.n++;
  }
  gs_status_t hs = gs_reduce_scatter_shards(c, sh.host, sh.n, GS_OP_SUM, 1.0, 0.5);
  gs_status_t ds = gs_reduce_scatter_shards(c, sh.dev, sh.n, GS_OP_SUM, 1.0, 0.5);
  CHECK(hs == ds, "reduce_scatter_shards: host %d, device %d", (int)hs, (int)ds);
  if (hs == GS_SUCCESS) {
    compare(sh.host, sh.dev, sh.n, exact, "reduce_scatter_shards");
    GS_OK(gs_allgather_shards(c, sh.host, sh.n));
    GS_OK(gs_allgather_shards(c, sh.dev, sh.n));
    compare(sh.host, sh.dev, sh.n, exact, "allgather_shards");
  }
  free_list(&sh);
}

static void kernels(void) {
  static const gs_dtype_t floats[4] = {GS_FLOAT16, GS_BFLOAT16, GS_FLOAT32, GS_FLOAT64};
  SECTION("accumulate, all 16 pairs, and overwrite");
  for (int overwrite = 0; overwrite < 2; overwrite++) {
    list_t acc, grad;
    acc.n = grad.n = 0;
    gs_rng_t r = gs_rng_make(800 + (uint64_t)overwrite, gs_test_rank());
    for (int a = 0; a < 4; a++)
      for (int g = 0; g < 4; g++) {
        int64_t n = SIZES[(a * 4 + g) % NSIZES];
        void *p[4] = {0};
        GS_OK(gs_malloc(HOST, (size_t)n * gs_dtype_size(floats[a]), &p[0]));
        GS_OK(gs_malloc(DEV, (size_t)n * gs_dtype_size(floats[a]), &p[1]));
        GS_OK(gs_malloc(HOST, (size_t)n * gs_dtype_size(floats[g]), &p[2]));
        GS_OK(gs_malloc(DEV, (size_t)n * gs_dtype_size(floats[g]), &p[3]));
        fill(&r, floats[a], p[0], n);
        fill(&r, floats[g], p[2], n);
        GS_OK(gs_memcpy(p[1], DEV, p[0], HOST, (size_t)n * gs_dtype_size(floats[a])));
        GS_OK(gs_memcpy(p[3], DEV, p[2], HOST, (size_t)n * gs_dtype_size(floats[g])));
        acc.host[acc.n] = (gs_tensor_t){p[0], n, floats[a], HOST};
        acc.dev[acc.n++] = (gs_tensor_t){p[1], n, floats[a], DEV};
        grad.host[grad.n] = (gs_tensor_t){p[2], n, floats[g], HOST};
        grad.dev[grad.n++] = (gs_tensor_t){p[3], n, floats[g], DEV};
      }
    GS_OK(gs_accumulate(acc.host, grad.host, acc.n, overwrite));
    GS_OK(gs_accumulate(acc.dev, grad.dev, acc.n, overwrite));
    compare(acc.host, acc.dev, acc.n, 1, overwrite ? "overwrite" : "accumulate");
    SECTION("scale");
    GS_OK(gs_scale(acc.host, acc.n, 0.1));
    GS_OK(gs_scale(acc.dev, acc.n, 0.1));
    compare(acc.host, acc.dev, acc.n, 1, "scale");
    SECTION("all_finite");
    int fh = -1, fd = -1;
    GS_OK(gs_all_finite(acc.host, acc.n, &fh));
    GS_OK(gs_all_finite(acc.dev, acc.n, &fd));
    CHECK(fh == 1 && fd == 1, "all_finite: host %d, device %d", fh, fd);
    double inf = INFINITY;
    GS_OK(gs_memcpy(acc.dev[acc.n - 1].data, DEV, &inf, HOST, sizeof inf)); /* a float64 */
    GS_OK(gs_all_finite(acc.dev, acc.n, &fd));
    CHECK(fd == 0, "all_finite missed an inf on the device");
    SECTION("zero");
    GS_OK(gs_zero(acc.dev, acc.n));
    GS_OK(gs_zero(acc.host, acc.n));
    compare(acc.host, acc.dev, acc.n, 1, "zero");
    free_list(&acc);
    free_list(&grad);
  }
}

static void bad_calls(gs_comm_t c) {
  SECTION("host and device memory mixed");
  list_t l;
  make_list(&l, 900, 1, 0, 0);
  gs_tensor_t mixed[2] = {l.host[3], l.dev[4]};
  GS_EXPECT(gs_allreduce(c, mixed, NULL, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("one device");
  GS_EXPECT(gs_allreduce(c, &l.host[3], &l.dev[3], 1, GS_OP_SUM, 1.0, 1.0),
            GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_accumulate(&l.host[3], &l.dev[3], 1, 0), GS_ERR_INVALID_ARGUMENT);
  free_list(&l);
}

/* Lazy module loading can deadlock against spinning NCCL kernels: under
 * the emulated runtime (which counts kernel loads by cudaFuncGetAttributes,
 * and NCCL launches made while a kernel of their device was not loaded),
 * every kernel was loaded before the first NCCL launch, none lazily after
 * one, and each once on this device however many communicators opened it. */
static void kernels_loaded_before_nccl(void) {
  long (*nccl_launches)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_launches");
  int (*count)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_kernel_count");
  long (*loads)(int, int) = (long (*)(int, int))dlsym(RTLD_DEFAULT, "gs_emulated_kernel_loads");
  long (*unloaded)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_unloaded_at_nccl");
  long (*lazy)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_lazy_after_nccl");
  if (!nccl_launches || !count || !loads || !unloaded || !lazy) return; /* real CUDA */
  SECTION("kernels loaded once per device, before NCCL work");
  for (int k = 0; k < count(); k++)
    CHECK(loads(DEV.id, k) == 1, "kernel %d was loaded %ld times on device %d (want once)", k,
          loads(DEV.id, k), DEV.id);
  CHECK(unloaded() == 0, "%ld NCCL launches (of %ld) found a kernel not loaded on their device",
        unloaded(), nccl_launches());
  CHECK(lazy() == 0, "%ld kernels were loaded lazily, at a launch after NCCL work", lazy());
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_device_paths");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int any = ndev;
  MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (any == 0) {
    if (gs_test_rank() == 0) printf("test_device_paths: no CUDA device, skipped\n");
    return gs_test_finish();
  }
  DEV.id = gs_test_rank() % ndev;
  gs_config_t cfg = {sizeof cfg, 4096, -1, 0.0, 1024}; /* small: many fused messages */
  setenv("GRADSYNC_NCCL", "0", 1);
  setenv("GRADSYNC_STAGE_CHUNK_BYTES", "4096", 1); /* many pipelined chunks */
  gs_comm_t staged = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &staged));
  allreduces(staged, 1);
  broadcasts_and_gathers(staged, 1);
  bad_calls(staged);
  GS_OK(gs_comm_free(&staged));
  unsetenv("GRADSYNC_NCCL");
  gs_comm_t any_path = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &any_path));
  allreduces(any_path, 0);
  broadcasts_and_gathers(any_path, 0);
  GS_OK(gs_comm_free(&any_path));
  kernels();
  kernels_loaded_before_nccl();
  return gs_test_finish();
}
