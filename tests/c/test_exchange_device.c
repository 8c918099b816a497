/* alltoallv, gatherv, scatterv, reduce and point-to-point messages on CUDA
 * memory against the same calls on host memory with the same inputs, on a
 * communicator forced onto staged MPI (GRADSYNC_NCCL=0) and on one that takes
 * whatever path the ranks agree on (NCCL with one GPU per rank; CUDA-aware
 * MPI under GRADSYNC_CUDA_AWARE_MPI=1). Values are multiples of 0.25, so
 * every path's reductions are exact and results must be bitwise equal.
 * GRADSYNC_MPI_MAX_COUNT=300 sends the larger tensors down the pairwise
 * (64-bit) paths. Skips (passes) when no CUDA device is visible; under
 * build/emulated/libgradsync.so (make test-emulated) it runs on the emulated
 * runtime. */
#include "gs_test.h"

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static gs_device_t DEV = {GS_DEVICE_CUDA, 0};
static int me, np;

typedef struct pair {
  gs_tensor_t h, d; /* the same bytes on the host and the device */
} pair_t;

static pair_t make(gs_dtype_t dt, int64_t n, uint64_t seed) {
  size_t bytes = (size_t)n * gs_dtype_size(dt);
  void *hp = NULL, *dp = NULL;
  GS_OK(gs_malloc(HOST, bytes, &hp));
  GS_OK(gs_malloc(DEV, bytes, &dp));
  gs_rng_t r = gs_rng_make(seed, me);
  for (int64_t i = 0; i < n; i++) {
    double v = gs_rng_int(&r, -40, 40) * 0.25;
    if (dt == GS_FLOAT32) ((float *)hp)[i] = (float)v;
    else if (dt == GS_INT32) ((int32_t *)hp)[i] = (int32_t)(v * 4);
    else ((uint16_t *)hp)[i] = gs_ref_double_to_f16(v);
  }
  GS_OK(gs_memcpy(dp, DEV, hp, HOST, bytes));
  return (pair_t){{hp, n, dt, HOST}, {dp, n, dt, DEV}};
}

static void release(pair_t *p) {
  gs_free(HOST, p->h.data);
  gs_free(DEV, p->d.data);
}

/* The device tensor holds the host tensor's bytes. */
static void same(const pair_t *p, const char *what) {
  size_t bytes = (size_t)p->h.count * gs_dtype_size(p->h.dtype);
  void *back = malloc(bytes ? bytes : 1);
  GS_OK(gs_memcpy(back, HOST, p->d.data, DEV, bytes));
  CHECK(memcmp(back, p->h.data, bytes) == 0, "%s: device result differs from the host's", what);
  free(back);
}

static const gs_dtype_t DTS[3] = {GS_FLOAT32, GS_FLOAT16, GS_INT32};

static void exchange_collectives(gs_comm_t c, const char *path) {
  int64_t *sc = malloc(sizeof(int64_t) * 3 * np), *rc = malloc(sizeof(int64_t) * 3 * np);
  SECTION("%s: alltoallv", path);
  pair_t in[3], out[3];
  for (int t = 0; t < 3; t++) {
    int64_t total = 0;
    for (int d = 0; d < np; d++)
      total += sc[d * 3 + t] = (me + 2 * d + t) % 4 == 0 ? 0 : 100 * (me + d + t) + 1;
    in[t] = make(DTS[t], total, 10 + t);
  }
  gs_tensor_t ih[3] = {in[0].h, in[1].h, in[2].h}, id[3] = {in[0].d, in[1].d, in[2].d};
  GS_OK(gs_alltoall_counts(c, ih, 3, NULL, sc, rc));
  for (int t = 0; t < 3; t++) {
    int64_t total = 0;
    for (int s = 0; s < np; s++) total += rc[s * 3 + t];
    out[t] = make(DTS[t], total, 20 + t);
  }
  gs_tensor_t oh[3] = {out[0].h, out[1].h, out[2].h}, od[3] = {out[0].d, out[1].d, out[2].d};
  GS_OK(gs_alltoallv(c, ih, oh, 3, sc, rc));
  GS_OK(gs_alltoallv(c, id, od, 3, sc, rc));
  for (int t = 0; t < 3; t++) same(&out[t], "alltoallv");

  for (int root = 0; root < np; root++) {
    SECTION("%s: gatherv/scatterv/reduce root %d", path, root);
    int64_t total[3] = {0, 0, 0};
    for (int r = 0; r < np; r++)
      for (int t = 0; t < 3; t++) total[t] += rc[r * 3 + t] = 250 * ((r + t + root) % 3) + r;
    pair_t mine[3], g[3], s[3], red[3];
    for (int t = 0; t < 3; t++) {
      mine[t] = make(DTS[t], rc[me * 3 + t], 70 + t);
      g[t] = make(DTS[t], me == root ? total[t] : 0, 30 + t);
      s[t] = make(DTS[t], rc[me * 3 + t], 40 + t);
      red[t] = make(DTS[t], 777 - 300 * t, 50 + t);
    }
    /* gather every rank's block, then scatter the gathered tensors back */
    gs_tensor_t mh[3] = {mine[0].h, mine[1].h, mine[2].h},
                md[3] = {mine[0].d, mine[1].d, mine[2].d};
    gs_tensor_t gh[3] = {g[0].h, g[1].h, g[2].h}, gd[3] = {g[0].d, g[1].d, g[2].d};
    GS_OK(gs_gatherv(c, mh, gh, 3, rc, root));
    GS_OK(gs_gatherv(c, md, gd, 3, rc, root));
    for (int t = 0; t < 3; t++) same(&g[t], "gatherv");
    gs_tensor_t sh[3] = {s[0].h, s[1].h, s[2].h}, sd[3] = {s[0].d, s[1].d, s[2].d};
    GS_OK(gs_scatterv(c, gh, sh, 3, rc, root));
    GS_OK(gs_scatterv(c, gd, sd, 3, rc, root));
    for (int t = 0; t < 3; t++) {
      same(&s[t], "scatterv");
      CHECK(memcmp(s[t].h.data, mine[t].h.data, (size_t)s[t].h.count * gs_dtype_size(DTS[t])) == 0,
            "scatterv of the gathered blocks does not give back this rank's block");
    }
    gs_tensor_t rh[3] = {red[0].h, red[1].h, red[2].h}, rd[3] = {red[0].d, red[1].d, red[2].d};
    gs_op_t op = root % 2 ? GS_OP_MAX : GS_OP_SUM;
    GS_OK(gs_reduce(c, rh, NULL, 3, op, 1.0, 1.0, root));
    GS_OK(gs_reduce(c, rd, NULL, 3, op, 1.0, 1.0, root));
    for (int t = 0; t < 3; t++) same(&red[t], "reduce in place");
    GS_OK(gs_reduce(c, rh, NULL, 2, GS_OP_AVERAGE, 2.0, 0.5, root)); /* float dtypes only */
    GS_OK(gs_reduce(c, rd, NULL, 2, GS_OP_AVERAGE, 2.0, 0.5, root));
    for (int t = 0; t < 2; t++) same(&red[t], "reduce average, scaled");
    for (int t = 0; t < 3; t++) {
      release(&mine[t]);
      release(&g[t]);
      release(&s[t]);
      release(&red[t]);
    }
  }
  for (int t = 0; t < 3; t++) {
    release(&in[t]);
    release(&out[t]);
  }
  free(sc);
  free(rc);
}

static void messages(gs_comm_t c, const char *path) {
  SECTION("%s: isend/irecv ring", path);
  pair_t out = make(GS_FLOAT16, 1001, 60), in = make(GS_FLOAT16, 1001, 61);
  pair_t expect = make(GS_FLOAT16, 0, 62);
  gs_request_t r[2];
  GS_OK(gs_irecv(c, &in.d, 1, (me + np - 1) % np, 4, &r[0]));
  GS_OK(gs_isend(c, &out.d, 1, (me + 1) % np, 4, &r[1]));
  GS_OK(gs_request_free(&r[1]));
  GS_OK(gs_request_free(&r[0]));
  GS_OK(gs_irecv(c, &in.h, 1, (me + np - 1) % np, 4, &r[0]));
  GS_OK(gs_isend(c, &out.h, 1, (me + 1) % np, 4, &r[1]));
  GS_OK(gs_request_free(&r[1]));
  GS_OK(gs_request_free(&r[0]));
  same(&in, "isend/irecv");
  release(&out);
  release(&in);
  release(&expect);
}

int main(int argc, char **argv) {
  setenv("GRADSYNC_MPI_MAX_COUNT", "300", 1);
  gs_test_init_thread(&argc, &argv, "test_exchange_device", MPI_THREAD_SERIALIZED);
  me = gs_test_rank();
  np = gs_test_size();
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int any = ndev;
  MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (any == 0) {
    if (me == 0) printf("test_exchange_device: no CUDA device, skipped\n");
    return gs_test_finish();
  }
  DEV.id = me % ndev;
  gs_config_t cfg = {sizeof cfg, 4096, -1, 0.0, 1024}; /* small: many fused messages */
  setenv("GRADSYNC_NCCL", "0", 1);
  gs_comm_t staged = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &staged));
  exchange_collectives(staged, "staged");
  messages(staged, "staged");
  GS_OK(gs_comm_free(&staged));
  unsetenv("GRADSYNC_NCCL");
  gs_comm_t any_path = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &any_path));
  exchange_collectives(any_path, "agreed path");
  messages(any_path, "agreed path");
  GS_OK(gs_comm_free(&any_path));
  return gs_test_finish();
}
