/* The exchange collectives and point-to-point messages from C, against
 * references every rank computes from every rank's regenerated inputs:
 * gs_alltoall_counts + gs_alltoallv (random uneven counts, zeros included),
 * gs_gatherv and gs_scatterv from every root, gs_reduce for every op with
 * prescale/postscale in and out of place over fused lists, the asynchronous
 * forms, gs_send/gs_recv/gs_isend/gs_irecv (tags, lists, overlap), and the
 * errors: counts that disagree, arguments one rank rejects, a receive of the
 * wrong dtype. (A receive no rank sends to, which times out and leaves its
 * communicator to MPI, is tested in tests/python/test_p2p.py: valgrind would
 * count that communicator as lost here.)
 *
 * GRADSYNC_MPI_MAX_COUNT is set to 700 elements before the first call, so
 * the larger tensors here take the 64-bit paths (pairwise chunked exchanges,
 * chunked reduces, one derived-datatype message per send) that real tensors
 * take past 2**31 elements. */
#include "gs_test.h"

#define MAXC 700

static int me, np;

/* Element i of tensor t on rank r, destined for block b: exact in every dtype
 * used here (small integers). */
static double value(int r, int t, int b, int64_t i) {
  return (double)((r * 7 + t * 3 + b * 5 + i) % 23) - 11;
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

static gs_tensor_t alloc_tensor(int64_t count, gs_dtype_t dt) {
  void *p = calloc((size_t)(count ? count : 1), gs_dtype_size(dt));
  return GS_HOST_TENSOR(p, count, dt);
}

/* The count tensor t sends from rank `from` to rank `to` in case `c`. */
static int64_t a2a_count(int c, int from, int to, int t) {
  gs_rng_t g = gs_rng_make(1000 + c * 100 + t, from * 64 + to);
  int64_t k = gs_rng_int(&g, 0, 5);
  return k == 0 ? 0 : k == 1 ? 1 : gs_rng_int(&g, 2, 2 * MAXC); /* some past MAXC */
}

static const gs_dtype_t a2a_dtypes[3] = {GS_FLOAT64, GS_INT8, GS_FLOAT16};

static void test_alltoallv(gs_comm_t comm, int c, int async) {
  SECTION("alltoallv case %d%s", c, async ? " (async)" : "");
  enum { N = 3 };
  int64_t *send = malloc(sizeof(int64_t) * N * np), *recv = malloc(sizeof(int64_t) * N * np);
  int64_t *got = malloc(sizeof(int64_t) * N * np);
  gs_tensor_t in[N], out[N];
  for (int t = 0; t < N; t++) {
    int64_t total = 0;
    for (int d = 0; d < np; d++) total += send[d * N + t] = a2a_count(c, me, d, t);
    in[t] = alloc_tensor(total, a2a_dtypes[t]);
    int64_t off = 0;
    for (int d = 0; d < np; d++)
      for (int64_t i = 0; i < send[d * N + t]; i++)
        put(in[t].dtype, in[t].data, off++, value(me, t, d, i));
  }
  GS_OK(gs_alltoall_counts(comm, in, N, NULL, send, got));
  int ok = 1;
  for (int s = 0; s < np; s++)
    for (int t = 0; t < N; t++) ok &= got[s * N + t] == (recv[s * N + t] = a2a_count(c, s, me, t));
  CHECK(ok, "gs_alltoall_counts returned the wrong counts");
  for (int t = 0; t < N; t++) {
    int64_t total = 0;
    for (int s = 0; s < np; s++) total += recv[s * N + t];
    out[t] = alloc_tensor(total, a2a_dtypes[t]);
  }
  if (async) {
    gs_request_t r;
    GS_OK(gs_alltoallv_async(comm, in, out, N, send, recv, &r));
    GS_OK(gs_request_wait(r));
    GS_OK(gs_request_free(&r));
  } else {
    GS_OK(gs_alltoallv(comm, in, out, N, send, recv));
  }
  int64_t bad = -1;
  for (int t = 0; t < N; t++) {
    int64_t off = 0;
    for (int s = 0; s < np; s++)
      for (int64_t i = 0; i < recv[s * N + t]; i++, off++)
        if (get(out[t].dtype, out[t].data, off) != value(s, t, me, i) && bad < 0) bad = off;
  }
  CHECK(bad < 0, "alltoallv: element %lld differs from the sender's", (long long)bad);
  for (int t = 0; t < N; t++) {
    free(in[t].data);
    free(out[t].data);
  }
  free(send);
  free(recv);
  free(got);
}

static void test_alltoallv_mismatch(gs_comm_t comm) {
  SECTION("alltoallv: counts that disagree");
  int64_t *send = calloc((size_t)np, sizeof *send), *recv = calloc((size_t)np, sizeof *recv);
  for (int r = 0; r < np; r++) send[r] = recv[r] = 2;
  if (me == np - 1) recv[0] = 3; /* expects one more element from rank 0 than it gets */
  gs_tensor_t in = alloc_tensor(2 * np, GS_INT32),
              out = alloc_tensor(2 * np + (me == np - 1), GS_INT32);
  for (int64_t i = 0; i < out.count; i++) ((int32_t *)out.data)[i] = -5;
  GS_EXPECT(gs_alltoallv(comm, &in, &out, 1, send, recv), GS_ERR_MISMATCH);
  CHECK_ERROR_MENTIONS("expects 3");
  int untouched = 1;
  for (int64_t i = 0; i < out.count; i++) untouched &= ((int32_t *)out.data)[i] == -5;
  CHECK(untouched, "a failed alltoallv wrote into out");
  /* an argument only one rank rejects: that rank says why, the others mismatch */
  send[0] = me == 0 ? -1 : 2;
  recv[0] = 2;
  gs_tensor_t out2 = alloc_tensor(2 * np, GS_INT32);
  gs_status_t s = gs_alltoallv(comm, &in, &out2, 1, send, recv);
  CHECK(s == (me == 0 ? GS_ERR_INVALID_ARGUMENT : GS_ERR_MISMATCH), "got %d: %s", (int)s,
        gs_last_error());
  free(in.data);
  free(out.data);
  free(out2.data);
  free(send);
  free(recv);
}

static void test_rooted(gs_comm_t comm, int async) {
  enum { N = 2 };
  static const gs_dtype_t dts[N] = {GS_BFLOAT16, GS_INT64};
  int64_t *counts = malloc(sizeof(int64_t) * N * np);
  for (int root = 0; root < np; root++) {
    SECTION("gatherv/scatterv root %d%s", root, async ? " (async)" : "");
    int64_t total[N] = {0, 0};
    for (int r = 0; r < np; r++)
      for (int t = 0; t < N; t++) total[t] += counts[r * N + t] = a2a_count(7 + root, r, root, t);
    gs_tensor_t in[N], whole[N], back[N];
    for (int t = 0; t < N; t++) {
      in[t] = alloc_tensor(counts[me * N + t], dts[t]);
      for (int64_t i = 0; i < in[t].count; i++) put(dts[t], in[t].data, i, value(me, t, 0, i));
      whole[t] = alloc_tensor(me == root ? total[t] : 0, dts[t]);
      back[t] = alloc_tensor(counts[me * N + t], dts[t]);
    }
    gs_request_t r1 = NULL, r2 = NULL;
    if (async) {
      GS_OK(gs_gatherv_async(comm, in, me == root ? whole : NULL, N, counts, root, &r1));
      GS_OK(gs_scatterv_async(comm, me == root ? whole : NULL, back, N, counts, root, &r2));
      GS_OK(gs_request_wait(r2)); /* completes in issue order: the gather first */
      GS_OK(gs_request_free(&r1));
      GS_OK(gs_request_free(&r2));
    } else {
      GS_OK(gs_gatherv(comm, in, me == root ? whole : NULL, N, counts, root));
      GS_OK(gs_scatterv(comm, me == root ? whole : NULL, back, N, counts, root));
    }
    int64_t bad = -1;
    for (int t = 0; me == root && t < N; t++) {
      int64_t off = 0;
      for (int r = 0; r < np; r++)
        for (int64_t i = 0; i < counts[r * N + t]; i++, off++)
          if (get(dts[t], whole[t].data, off) != value(r, t, 0, i) && bad < 0) bad = off;
    }
    CHECK(bad < 0, "gatherv: element %lld at the root is wrong", (long long)bad);
    bad = -1;
    for (int t = 0; t < N; t++)
      for (int64_t i = 0; i < back[t].count; i++)
        if (get(dts[t], back[t].data, i) != value(me, t, 0, i) && bad < 0) bad = i;
    CHECK(bad < 0, "scatterv of the gathered tensors: element %lld is not this rank's",
          (long long)bad);
    for (int t = 0; t < N; t++) {
      free(in[t].data);
      free(whole[t].data);
      free(back[t].data);
    }
  }
  free(counts);
}

static void test_rooted_errors(gs_comm_t comm) {
  SECTION("gatherv/scatterv errors");
  int64_t *counts = malloc(sizeof(int64_t) * np);
  for (int r = 0; r < np; r++) counts[r] = 3;
  if (me == np - 1) counts[0] = 4; /* this rank thinks rank 0 sends 4 */
  gs_tensor_t in = alloc_tensor(me == 0 && me == np - 1 ? 4 : 3, GS_FLOAT32);
  int64_t total = 0;
  for (int r = 0; r < np; r++) total += counts[r];
  gs_tensor_t out = alloc_tensor(total, GS_FLOAT32);
  for (int64_t i = 0; i < out.count; i++) ((float *)out.data)[i] = 42.f;
  gs_status_t s = gs_gatherv(comm, &in, &out, 1, counts, 0);
  CHECK(s == (np == 1 ? GS_SUCCESS : GS_ERR_MISMATCH), "gatherv with disagreeing counts: %d (%s)",
        (int)s, gs_last_error());
  if (np > 1) {
    CHECK_ERROR_MENTIONS("per-rank counts");
    int untouched = 1;
    for (int64_t i = 0; i < out.count; i++) untouched &= ((float *)out.data)[i] == 42.f;
    CHECK(untouched, "a failed gatherv wrote into out");
  }
  for (int r = 0; r < np; r++) counts[r] = 3;
  in.count = 3;
  /* a root only the last rank names wrongly: it rejects its argument */
  s = gs_scatterv(comm, me == 0 ? &out : NULL, &in, 1, counts, me == np - 1 ? np : 0);
  CHECK(s == (me == np - 1 ? GS_ERR_INVALID_ARGUMENT : GS_ERR_MISMATCH), "scatterv bad root: %d",
        (int)s);
  if (me == np - 1) CHECK_ERROR_MENTIONS("root");
  free(in.data);
  free(out.data);
  free(counts);
}

static const gs_op_t ops[5] = {GS_OP_SUM, GS_OP_AVERAGE, GS_OP_MIN, GS_OP_MAX, GS_OP_PROD};

static double combine(gs_op_t op, double a, double b) {
  switch (op) {
    case GS_OP_MIN: return a < b ? a : b;
    case GS_OP_MAX: return a > b ? a : b;
    case GS_OP_PROD: return a * b;
    default: return a + b;
  }
}

/* A reduce of a list whose sizes pass the 4 KiB threshold of `comm`. */
/* What rank r holds at element i of tensor t in reduce case oi (exact in dt). */
static double reduce_input(gs_dtype_t dt, gs_op_t op, int r, int t, int oi, int64_t i) {
  double v = value(r, t, oi, i) / (op == GS_OP_PROD ? 4 : 1); /* keeps products small */
  return dt == GS_INT32 ? (double)(int32_t)v : v;
}

static void test_reduce(gs_comm_t comm, int async) {
  enum { N = 4 };
  static const int64_t sizes[N] = {0, 1, 1001, 3003}; /* 3003 float64 > 4 KiB */
  static const gs_dtype_t dts[2] = {GS_FLOAT64, GS_INT32};
  for (int di = 0; di < 2; di++)
    for (int oi = 0; oi < 5; oi++)
      for (int inplace = 0; inplace < 2; inplace++) {
        gs_dtype_t dt = dts[di];
        gs_op_t op = ops[oi];
        if (dt == GS_INT32 && op == GS_OP_AVERAGE) continue;
        int root = (oi + inplace) % np;
        double pre = dt == GS_FLOAT64 ? 0.5 : 1.0, post = dt == GS_FLOAT64 ? 4.0 : 1.0;
        SECTION("reduce %s %s root %d %s%s", gs_dtype_name(dt), gs_op_name(op), root,
                inplace ? "in place" : "out of place", async ? " (async)" : "");
        gs_tensor_t in[N], out[N];
        for (int t = 0; t < N; t++) {
          in[t] = alloc_tensor(sizes[t], dt);
          out[t] = alloc_tensor(sizes[t], dt);
          for (int64_t i = 0; i < sizes[t]; i++) {
            put(dt, in[t].data, i, reduce_input(dt, op, me, t, oi, i));
            put(dt, out[t].data, i, 99);
          }
        }
        const gs_tensor_t *o = inplace ? in : out;
        if (async) {
          gs_request_t r;
          GS_OK(gs_reduce_async(comm, in, o, N, op, pre, post, root, &r));
          GS_OK(gs_request_wait(r));
          GS_OK(gs_request_free(&r));
        } else {
          GS_OK(gs_reduce(comm, in, o, N, op, pre, post, root));
        }
        int64_t bad = -1, changed = -1;
        for (int t = 0; t < N; t++)
          for (int64_t i = 0; i < sizes[t]; i++) {
            double mine = get(dt, in[t].data, i), want = 0;
            /* inputs never change, except the root's in place */
            if ((me != root || !inplace) && mine != reduce_input(dt, op, me, t, oi, i) &&
                changed < 0)
              changed = i;
            if (me != root) continue;
            for (int r = 0; r < np; r++) {
              double x = reduce_input(dt, op, r, t, oi, i) * pre;
              want = r ? combine(op, want, x) : x;
            }
            want *= post * (op == GS_OP_AVERAGE ? 1.0 / np : 1.0);
            double got = get(dt, inplace ? in[t].data : out[t].data, i);
            if (fabs(got - want) > 1e-9 * (1 + fabs(want)) && bad < 0) bad = t * 100000 + i;
          }
        CHECK(bad < 0, "reduce: tensor %lld element %lld wrong", (long long)(bad / 100000),
              (long long)(bad % 100000));
        CHECK(changed < 0, "reduce changed an input it only reads (element %lld)",
              (long long)changed);
        for (int t = 0; t < N; t++) {
          free(in[t].data);
          free(out[t].data);
        }
      }
  SECTION("reduce errors");
  double x[3] = {1, 2, 3};
  gs_tensor_t t = GS_HOST_TENSOR(x, 3, GS_FLOAT64);
  GS_EXPECT(gs_reduce(comm, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0, me == 0 ? 0 : np - 1),
            np == 1 ? GS_SUCCESS : GS_ERR_MISMATCH);
  GS_EXPECT(gs_reduce(comm, &t, NULL, 1, GS_OP_ADASUM, 1.0, 1.0, 0), GS_ERR_INVALID_ARGUMENT);
}

static void test_p2p(gs_comm_t comm) {
  SECTION("send/recv: ring with tags, lists and overlap");
  int next = (me + 1) % np, prev = (me + np - 1) % np;
  enum { N = 3 };
  static const int64_t sizes[N] = {0, 5, 2 * MAXC + 3}; /* the last: a derived datatype */
  gs_tensor_t out[2][N], in[2][N];
  for (int tag = 0; tag < 2; tag++)
    for (int t = 0; t < N; t++) {
      out[tag][t] = alloc_tensor(sizes[t], GS_FLOAT32);
      in[tag][t] = alloc_tensor(sizes[t], GS_FLOAT32);
      for (int64_t i = 0; i < sizes[t]; i++)
        put(GS_FLOAT32, out[tag][t].data, i, value(me, t, tag, i));
    }
  gs_request_t r[4];
  /* receives posted in the opposite tag order to the sends: tags keep them apart */
  GS_OK(gs_irecv(comm, in[1], N, prev, 11, &r[0]));
  GS_OK(gs_isend(comm, out[0], N, next, 10, &r[1]));
  GS_OK(gs_isend(comm, out[1], N, next, 11, &r[2]));
  GS_OK(gs_irecv(comm, in[0], N, prev, 10, &r[3]));
  for (int k = 3; k >= 0; k--) GS_OK(gs_request_wait(r[k]));
  for (int k = 0; k < 4; k++) GS_OK(gs_request_free(&r[k]));
  int64_t bad = -1;
  for (int tag = 0; tag < 2; tag++)
    for (int t = 0; t < N; t++)
      for (int64_t i = 0; i < sizes[t]; i++)
        if (get(GS_FLOAT32, in[tag][t].data, i) != value(prev, t, tag, i) && bad < 0) bad = i;
  CHECK(bad < 0, "ring: element %lld not the previous rank's", (long long)bad);

  SECTION("send/recv: blocking, in pairs");
  if (np > 1 && me < np - np % 2) {
    int peer = me ^ 1;
    for (int t = 0; t < N; t++)
      for (int64_t i = 0; i < sizes[t]; i++) put(GS_FLOAT32, in[0][t].data, i, -1);
    if (me % 2 == 0) {
      GS_OK(gs_send(comm, out[0], N, peer, 3));
      GS_OK(gs_recv(comm, in[0], N, peer, 3));
    } else {
      GS_OK(gs_recv(comm, in[0], N, peer, 3));
      GS_OK(gs_send(comm, out[0], N, peer, 3));
    }
    bad = -1;
    for (int t = 0; t < N; t++)
      for (int64_t i = 0; i < sizes[t]; i++)
        if (get(GS_FLOAT32, in[0][t].data, i) != value(peer, t, 0, i) && bad < 0) bad = i;
    CHECK(bad < 0, "pairs: element %lld wrong", (long long)bad);
  }

  SECTION("send/recv: the wrong dtype, then the matching next message");
  int32_t wrong[5] = {1, 2, 3, 4, 5};
  gs_tensor_t w = GS_HOST_TENSOR(wrong, 5, GS_INT32);
  gs_request_t rs;
  GS_OK(gs_isend(comm, &w, 1, next, 5, &rs));
  GS_OK(gs_isend(comm, &out[0][1], 1, next, 5, &r[0]));
  GS_EXPECT(gs_recv(comm, &in[0][1], 1, prev, 5), GS_ERR_MISMATCH);
  CHECK_ERROR_MENTIONS("int32");
  GS_OK(gs_recv(comm, &in[0][1], 1, prev, 5)); /* the next message still matches */
  CHECK(get(GS_FLOAT32, in[0][1].data, 4) == value(prev, 1, 0, 4), "second message wrong");
  GS_OK(gs_request_free(&rs));
  GS_OK(gs_request_free(&r[0]));

  SECTION("send/recv: argument errors");
  GS_EXPECT(gs_send(comm, &w, 1, np, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("dest");
  GS_EXPECT(gs_recv(comm, &w, 1, -1, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("source");
  GS_EXPECT(gs_send(comm, &w, 1, next, -2), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("tag");
  int max_tag = 0;
  GS_OK(gs_p2p_max_tag(comm, &max_tag));
  CHECK(max_tag >= 16383, "max tag %d", max_tag);
  for (int tag = 0; tag < 2; tag++)
    for (int t = 0; t < N; t++) {
      free(out[tag][t].data);
      free(in[tag][t].data);
    }
  MPI_Barrier(MPI_COMM_WORLD);
}

/* Receives from any source (gs_recv_any, gs_irecv_any) and gs_p2p_probe:
 * every rank but 0 sends rank 0 a list of two messages; rank 0 takes them
 * without naming senders and must get each rank's pair exactly once, from
 * the sender it reports. */
static void test_p2p_any(gs_comm_t comm) {
  SECTION("send/recv: receives from any source, probe");
  enum { TAG = 20, PROBE_TAG = 21, ORDER_TAG = 22 };
  int64_t pair[2][3];
  gs_tensor_t mine[2] = {GS_HOST_TENSOR(pair[0], 3, GS_INT64),
                         GS_HOST_TENSOR(pair[1], 3, GS_INT64)};
  int found = 7;
  GS_OK(gs_p2p_probe(comm, GS_ANY_SOURCE, PROBE_TAG, &found));
  CHECK(found == -1, "probe found rank %d before anyone sent", found);
  MPI_Barrier(MPI_COMM_WORLD); /* nobody sends before every rank has probed */
  if (me != 0) {
    for (int k = 0; k < 2; k++)
      for (int i = 0; i < 3; i++) pair[k][i] = 100 * me + 10 * k + i;
    GS_OK(gs_send(comm, mine, 2, 0, TAG));
  } else {
    int *seen = calloc((size_t)np, sizeof *seen);
    gs_request_t *reqs = calloc((size_t)np, sizeof *reqs);
    int64_t (*got)[2][3] = calloc((size_t)np, sizeof *got);
    int *from = calloc((size_t)np, sizeof *from);
    for (int k = 1; k < np; k++) {
      gs_tensor_t into[2] = {GS_HOST_TENSOR(got[k][0], 3, GS_INT64),
                             GS_HOST_TENSOR(got[k][1], 3, GS_INT64)};
      if (k == 1) {
        GS_OK(gs_recv_any(comm, into, 2, TAG, &from[k]));
      } else {
        GS_OK(gs_irecv_any(comm, into, 2, TAG, &from[k], &reqs[k]));
        CHECK(from[k] == -1 || from[k] > 0, "an unmatched receive reports rank %d", from[k]);
      }
    }
    for (int k = 2; k < np; k++) {
      GS_OK(gs_request_wait(reqs[k]));
      GS_OK(gs_request_free(&reqs[k]));
    }
    for (int k = 1; k < np; k++) {
      int r = from[k];
      CHECK(r > 0 && r < np, "receive %d reports sender %d", k, r);
      if (r <= 0 || r >= np) continue;
      seen[r]++;
      int ok = 1;
      for (int j = 0; j < 2; j++)
        for (int i = 0; i < 3; i++) ok &= got[k][j][i] == 100 * r + 10 * j + i;
      CHECK(ok, "receive %d: the data is not rank %d's", k, r);
    }
    for (int r = 1; r < np; r++) CHECK(seen[r] == 1, "rank %d received %d times", r, seen[r]);
    free(seen);
    free(reqs);
    free(got);
    free(from);
  }
  MPI_Barrier(MPI_COMM_WORLD);

  if (np > 1) { /* probe: sees a waiting message without taking it */
    int64_t one = 41;
    gs_tensor_t t = GS_HOST_TENSOR(&one, 1, GS_INT64);
    if (me == np - 1) GS_OK(gs_send(comm, &t, 1, 0, PROBE_TAG));
    if (me == 0) {
      double t0 = MPI_Wtime();
      found = -1;
      while (found < 0 && MPI_Wtime() - t0 < 60)
        GS_OK(gs_p2p_probe(comm, np - 1, PROBE_TAG, &found));
      CHECK(found == np - 1, "probe from rank %d found %d", np - 1, found);
      GS_OK(gs_p2p_probe(comm, GS_ANY_SOURCE, PROBE_TAG, &found));
      CHECK(found == np - 1, "probe from any rank found %d", found);
      one = 0;
      GS_OK(gs_recv(comm, &t, 1, np - 1, PROBE_TAG));
      CHECK(one == 41, "the probed message holds %lld", (long long)one);
      GS_OK(gs_p2p_probe(comm, GS_ANY_SOURCE, PROBE_TAG, &found));
      CHECK(found == -1, "a received message is still probed (%d)", found);
    }
    /* a receive from rank 1 posted before a receive from any source takes
     * the first message; the receive from any source the second */
    int64_t a = -1, b = -1;
    gs_tensor_t ta = GS_HOST_TENSOR(&a, 1, GS_INT64), tb = GS_HOST_TENSOR(&b, 1, GS_INT64);
    if (me == 0) {
      gs_request_t ra, rb;
      int src = -5;
      GS_OK(gs_irecv(comm, &ta, 1, 1, ORDER_TAG, &ra));
      GS_OK(gs_irecv_any(comm, &tb, 1, ORDER_TAG, &src, &rb));
      MPI_Barrier(MPI_COMM_WORLD);
      GS_OK(gs_request_wait(rb));
      GS_OK(gs_request_wait(ra));
      CHECK(a == 1 && b == 2 && src == 1, "order: got %lld then %lld from %d", (long long)a,
            (long long)b, src);
      GS_OK(gs_request_free(&ra));
      GS_OK(gs_request_free(&rb));
    } else {
      MPI_Barrier(MPI_COMM_WORLD);
      if (me == 1) {
        a = 1;
        b = 2;
        GS_OK(gs_send(comm, &ta, 1, 0, ORDER_TAG));
        GS_OK(gs_send(comm, &tb, 1, 0, ORDER_TAG));
      }
    }
  }

  int src = 3;
  GS_EXPECT(gs_recv_any(comm, mine, 1, -1, &src), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("tag");
  GS_EXPECT(gs_p2p_probe(comm, np, 0, &found), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("source");
  GS_EXPECT(gs_recv(comm, mine, 1, GS_ANY_SOURCE, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("source");
  int64_t none = 0;
  gs_tensor_t empty = GS_HOST_TENSOR(&none, 0, GS_INT64);
  GS_OK(gs_recv_any(comm, &empty, 0, 0, &src)); /* nothing to receive: done at once */
  CHECK(src == -1, "a receive of no messages reports sender %d", src);
  MPI_Barrier(MPI_COMM_WORLD);
}

/* A communicator's own timeout replaces the process-wide one for its waits
 * only: a receive nobody sends to fails after it, naming it; another
 * communicator is unaffected and still usable. */
static void test_comm_timeout(void) {
  SECTION("gs_comm_set_timeout: a receive nobody sends to");
  gs_comm_t a = NULL, b = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &a));
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &b));
  double seconds = -1;
  GS_OK(gs_comm_timeout(a, &seconds));
  CHECK(seconds == 0, "a new communicator has its own timeout %g", seconds);
  GS_OK(gs_comm_set_timeout(a, 0.3));
  GS_OK(gs_comm_timeout(a, &seconds));
  CHECK(seconds == 0.3, "timeout reads back as %g", seconds);
  GS_EXPECT(gs_comm_set_timeout(a, -1), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("seconds");
  int64_t x = 0;
  gs_tensor_t t = GS_HOST_TENSOR(&x, 1, GS_INT64);
  GS_EXPECT(gs_recv(a, &t, 1, me, 99), GS_ERR_TIMEOUT);
  CHECK_ERROR_MENTIONS("the communicator's timeout of 0.3 s");
  GS_EXPECT(gs_recv_any(a, &t, 1, 99, NULL), GS_ERR_TIMEOUT); /* a is unusable now */
  gs_comm_t child = NULL;
  GS_OK(gs_comm_set_timeout(b, 600));
  GS_OK(gs_comm_split(b, 0, me, &child)); /* b still works; a split inherits its timeout */
  GS_OK(gs_comm_timeout(child, &seconds));
  CHECK(seconds == 600, "a split of b has timeout %g", seconds);
  GS_OK(gs_barrier(b));
  GS_OK(gs_comm_free(&child));
  gs_test_stderr_begin();
  GS_OK(gs_comm_free(&a));
  const char *log = gs_test_stderr_end();
  CHECK_LOGGED(log,
               "WARNING: freeing a communicator abandoned after a collective took longer "
               "than its timeout");
  GS_OK(gs_comm_free(&b));
}

static void test_async_gather_scatter(gs_comm_t comm) {
  SECTION("allgatherv/reduce_scatter async");
  int64_t *counts = malloc(sizeof(int64_t) * np), total = 0;
  for (int r = 0; r < np; r++) total += counts[r] = 2 * r + 1;
  gs_tensor_t in = alloc_tensor(counts[me], GS_FLOAT64), out = alloc_tensor(total, GS_FLOAT64);
  for (int64_t i = 0; i < in.count; i++) put(GS_FLOAT64, in.data, i, value(me, 0, 0, i));
  gs_tensor_t rin = alloc_tensor(3 * np, GS_FLOAT64), rout = alloc_tensor(3, GS_FLOAT64);
  for (int64_t i = 0; i < rin.count; i++) put(GS_FLOAT64, rin.data, i, value(me, 1, 0, i));
  int64_t rows = np;
  gs_request_t a, b;
  GS_OK(gs_allgatherv_async(comm, &in, &out, 1, counts, &a));
  GS_OK(gs_reduce_scatter_async(comm, &rin, &rout, 1, &rows, GS_OP_SUM, 1.0, 1.0, &b));
  GS_OK(gs_request_wait(b));
  GS_OK(gs_request_wait(a));
  int64_t bad = -1, off = 0;
  for (int r = 0; r < np; r++)
    for (int64_t i = 0; i < counts[r]; i++, off++)
      if (get(GS_FLOAT64, out.data, off) != value(r, 0, 0, i) && bad < 0) bad = off;
  CHECK(bad < 0, "allgatherv_async element %lld", (long long)bad);
  bad = -1;
  for (int64_t i = 0; i < 3; i++) {
    double want = 0;
    for (int r = 0; r < np; r++) want += value(r, 1, 0, 3 * me + i);
    if (get(GS_FLOAT64, rout.data, i) != want && bad < 0) bad = i;
  }
  CHECK(bad < 0, "reduce_scatter_async element %lld", (long long)bad);
  GS_OK(gs_request_free(&a));
  GS_OK(gs_request_free(&b));
  free(in.data);
  free(out.data);
  free(rin.data);
  free(rout.data);
  free(counts);
}

int main(int argc, char **argv) {
  setenv("GRADSYNC_MPI_MAX_COUNT", "700", 1);
  int level = gs_test_init_thread(&argc, &argv, "test_exchange", MPI_THREAD_SERIALIZED);
  CHECK(level >= MPI_THREAD_SERIALIZED, "MPI provides thread level %d", level);
  me = gs_test_rank();
  np = gs_test_size();
  gs_comm_t comm = NULL, small = NULL;
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.fusion_threshold = 4096;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &small));
  for (int c = 0; c < 3; c++) test_alltoallv(comm, c, c == 2);
  test_alltoallv_mismatch(comm);
  test_rooted(comm, 0);
  test_rooted(comm, 1);
  test_rooted_errors(comm);
  test_reduce(small, 0);
  test_reduce(comm, 1);
  test_async_gather_scatter(comm);
  test_p2p(comm);
  test_p2p_any(comm);
  test_comm_timeout();
  GS_OK(gs_comm_free(&comm));
  GS_OK(gs_comm_free(&small));
  return gs_test_finish();
}
