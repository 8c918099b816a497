/* Errors: argument errors return the right status with a message naming the
 * argument; ranks that disagree get GS_ERR_MISMATCH on every rank, with a
 * message naming what differs, and no buffer is touched; an argument error on
 * one rank only returns its own status there and GS_ERR_MISMATCH elsewhere;
 * the communicator keeps working afterwards. */
#include "gs_test.h"

static gs_comm_t comm;
static int rank_, size_;

/* A few buffers whose contents must survive every failing call. */
enum { NB = 64 };
static float fa[NB], fb[NB], fc[NB];
static int32_t ia[NB];

static void fill_pattern(void) {
  for (int i = 0; i < NB; i++) {
    fa[i] = (float)(rank_ * 1000 + i);
    fb[i] = (float)(-rank_ * 1000 - i);
    fc[i] = 0.5f + (float)i;
    ia[i] = rank_ * 7 + i;
  }
}

static uint64_t pattern_hash(void) {
  uint64_t h = gs_hash_bytes(0, fa, sizeof fa);
  h = gs_hash_bytes(h, fb, sizeof fb);
  h = gs_hash_bytes(h, fc, sizeof fc);
  return gs_hash_bytes(h, ia, sizeof ia);
}

#define UNTOUCHED(h) CHECK(pattern_hash() == (h), "a failing call wrote into a buffer")

/* The communicator still works: a sum over ranks is right on every rank. */
static void check_comm_works(gs_comm_t c) {
  double v[3] = {1.0, (double)rank_, -2.0};
  gs_tensor_t t = GS_HOST_TENSOR(v, 3, GS_FLOAT64);
  GS_OK(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  CHECK(v[0] == size_ && v[1] == size_ * (size_ - 1) / 2.0 && v[2] == -2.0 * size_,
        "after the errors: %g %g %g", v[0], v[1], v[2]);
  GS_OK(gs_barrier(c));
}

/* ---- argument errors (made on every rank alike) -------------------------- */

static void test_null_comm(void) {
  SECTION("NULL communicator");
  gs_tensor_t t = GS_HOST_TENSOR(fa, NB, GS_FLOAT32);
  int v = 0;
  int64_t c = 0, first;
  GS_EXPECT(gs_allreduce(NULL, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("comm");
  GS_EXPECT(gs_broadcast(NULL, &t, 1, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("comm");
  GS_EXPECT(gs_allgather_counts(NULL, &t, 1, NULL, &c), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_allgatherv(NULL, &t, &t, 1, &c), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_reduce_scatter(NULL, &t, &t, 1, NULL, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_allgather_shards(NULL, &t, 1), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_reduce_scatter_shards(NULL, &t, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_barrier(NULL), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_comm_rank(NULL, &v), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("comm");
  GS_EXPECT(gs_comm_size(NULL, &v), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_comm_set_fusion_threshold(NULL, 100), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_comm_abandon(NULL, GS_ERR_INVALID_ARGUMENT, "x"), GS_ERR_INVALID_ARGUMENT);
  gs_comm_t out = (gs_comm_t)&v;
  GS_EXPECT(gs_comm_split(NULL, 0, 0, &out), GS_ERR_INVALID_ARGUMENT);
  CHECK(out == NULL, "gs_comm_split sets *out to NULL on failure");
  GS_EXPECT(gs_comm_rank(comm, NULL), GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_block_range(10, 1, 2, 0, &first, NULL), GS_ERR_INVALID_ARGUMENT);
}

static void test_comm_lifecycle(void) {
  SECTION("gs_comm_create / gs_comm_free arguments");
  GS_EXPECT(gs_comm_create(MPI_COMM_WORLD, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  gs_comm_t c = (gs_comm_t)fa;
  GS_EXPECT(gs_comm_create(MPI_COMM_NULL, NULL, &c), GS_ERR_INVALID_ARGUMENT);
  CHECK(c == NULL, "gs_comm_create sets *comm to NULL on failure");
  CHECK_ERROR_MENTIONS("mpi_comm");

  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &c));
  CHECK(c != NULL);
  check_comm_works(c);
  GS_OK(gs_comm_free(&c));
  CHECK(c == NULL, "gs_comm_free sets the handle to NULL");
  GS_OK(gs_comm_free(&c)); /* again: a no-op */
  CHECK(c == NULL);
  GS_OK(gs_comm_free(NULL));

  SECTION("fusion threshold arguments");
  GS_EXPECT(gs_comm_set_fusion_threshold(comm, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("bytes");
  GS_EXPECT(gs_comm_set_fusion_threshold(comm, -5), GS_ERR_INVALID_ARGUMENT);
  int64_t th = 0;
  GS_OK(gs_comm_fusion_threshold(comm, &th));
  CHECK(th > 0, "the threshold is unchanged by a rejected setting: %lld", (long long)th);
  GS_EXPECT(gs_comm_fusion_threshold(comm, NULL), GS_ERR_INVALID_ARGUMENT);
}

static void test_tensor_arguments(void) {
  fill_pattern();
  uint64_t h = pattern_hash();
  gs_tensor_t t[3] = {GS_HOST_TENSOR(fa, NB, GS_FLOAT32), GS_HOST_TENSOR(fb, NB, GS_FLOAT32),
                      GS_HOST_TENSOR(fc, NB, GS_FLOAT32)};
  gs_tensor_t o[3] = {GS_HOST_TENSOR(fc, NB, GS_FLOAT32), GS_HOST_TENSOR(fc, NB, GS_FLOAT32),
                      GS_HOST_TENSOR(fc, NB, GS_FLOAT32)};

  SECTION("NULL tensor list with n > 0");
  GS_EXPECT(gs_allreduce(comm, NULL, NULL, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("in is NULL");
  GS_EXPECT(gs_broadcast(comm, NULL, 1, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("tensors is NULL");
  GS_EXPECT(gs_allreduce(comm, t, NULL, 0, GS_OP_SUM, 1.0, 1.0), GS_SUCCESS); /* n = 0: fine */
  UNTOUCHED(h);

  SECTION("negative counts");
  GS_EXPECT(gs_allreduce(comm, t, NULL, -1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("n (number of tensors)");
  gs_tensor_t neg[2] = {t[0], GS_HOST_TENSOR(fb, -5, GS_FLOAT32)};
  GS_EXPECT(gs_allreduce(comm, neg, NULL, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("in[1]");
  CHECK_ERROR_MENTIONS("-5");
  GS_EXPECT(gs_broadcast(comm, neg, 2, 0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("tensors[1]");
  gs_tensor_t nodata = GS_HOST_TENSOR(NULL, 4, GS_FLOAT32);
  GS_EXPECT(gs_allreduce(comm, &nodata, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("in[0].data");
  UNTOUCHED(h);

  SECTION("unknown dtype");
  gs_tensor_t bad_dt[2] = {t[0], GS_HOST_TENSOR(fb, NB, (gs_dtype_t)99)};
  GS_EXPECT(gs_allreduce(comm, bad_dt, NULL, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("in[1]");
  CHECK_ERROR_MENTIONS("dtype 99");
  GS_EXPECT(gs_broadcast(comm, bad_dt, 2, 0), GS_ERR_TYPE);
  GS_EXPECT(gs_allreduce(comm, t, bad_dt, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("out[1]");
  CHECK(gs_dtype_size((gs_dtype_t)99) == 0 &&
        strcmp(gs_dtype_name((gs_dtype_t)99), "unknown") == 0);
  CHECK(strcmp(gs_op_name((gs_op_t)99), "unknown") == 0);
  UNTOUCHED(h);

  SECTION("unknown device");
  gs_tensor_t dev = t[0];
  dev.device.kind = (gs_device_kind_t)42;
  GS_EXPECT(gs_allreduce(comm, &dev, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("device");
  if (gs_cuda_version() == 0) {
    dev.device.kind = GS_DEVICE_CUDA;
    GS_EXPECT(gs_allreduce(comm, &dev, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("in[0]");
  }
  dev.device.kind = GS_DEVICE_CUDA_HOST; /* pinned host memory is host memory */
  GS_OK(gs_allreduce(comm, &dev, NULL, 1, GS_OP_MAX, 1.0, 1.0));
  fill_pattern();
  h = pattern_hash();

  SECTION("op out of range");
  GS_EXPECT(gs_allreduce(comm, t, NULL, 1, (gs_op_t)17, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("op 17");
  GS_EXPECT(gs_allreduce(comm, t, NULL, 1, (gs_op_t)-1, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("op");
  GS_EXPECT(gs_reduce_scatter(comm, t, o, 1, NULL, (gs_op_t)6, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("op");
  UNTOUCHED(h);

  SECTION("average / scales on integers");
  gs_tensor_t it = GS_HOST_TENSOR(ia, NB, GS_INT32);
  GS_EXPECT(gs_allreduce(comm, &it, NULL, 1, GS_OP_AVERAGE, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("average");
  CHECK_ERROR_MENTIONS("int32");
  GS_EXPECT(gs_allreduce(comm, &it, NULL, 1, GS_OP_SUM, 0.5, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("prescale");
  GS_EXPECT(gs_allreduce(comm, &it, NULL, 1, GS_OP_SUM, 1.0, 2.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("postscale");
  gs_tensor_t mixed[2] = {t[0], it}; /* one integer tensor in the list is enough */
  GS_EXPECT(gs_allreduce(comm, mixed, NULL, 2, GS_OP_AVERAGE, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("tensor 1");
  UNTOUCHED(h);

  SECTION("bad root");
  GS_EXPECT(gs_broadcast(comm, t, 1, size_), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("root");
  GS_EXPECT(gs_broadcast(comm, t, 1, -1), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("root -1");
  UNTOUCHED(h);

  SECTION("out overlapping in");
  gs_tensor_t shifted = GS_HOST_TENSOR(fa + 3, NB - 3, GS_FLOAT32);
  gs_tensor_t head = GS_HOST_TENSOR(fa, NB - 3, GS_FLOAT32);
  GS_EXPECT(gs_allreduce(comm, &head, &shifted, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("overlaps");
  CHECK_ERROR_MENTIONS("out[0]");
  GS_EXPECT(gs_allreduce(comm, &shifted, &head, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  UNTOUCHED(h);

  SECTION("out[i] overlapping another input");
  /* gs_collectives.h: out[i] "must not overlap any input". Here out[0] is
   * in[1]'s memory. (When both lists are back to back and large, an unchecked
   * overlap reaches MPI_Allreduce as aliased send/recv buffers, which MPICH
   * aborts on; this small case only checks that the overlap is rejected.) */
  gs_tensor_t cross_out[2] = {GS_HOST_TENSOR(fb, NB, GS_FLOAT32),
                              GS_HOST_TENSOR(fc, NB, GS_FLOAT32)};
  GS_EXPECT(gs_allreduce(comm, t, cross_out, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("overlap");
  UNTOUCHED(h);
  fill_pattern();
  h = pattern_hash();

  SECTION("out does not match in");
  gs_tensor_t short_out = GS_HOST_TENSOR(fc, NB - 1, GS_FLOAT32);
  GS_EXPECT(gs_allreduce(comm, t, &short_out, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("out[0]");
  gs_tensor_t int_out = GS_HOST_TENSOR(fc, NB, GS_INT32);
  GS_EXPECT(gs_allreduce(comm, t, &int_out, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("out[0]");
  UNTOUCHED(h);

  SECTION("reduce_scatter arguments");
  int64_t rows[1] = {7};
  gs_tensor_t in63 = GS_HOST_TENSOR(fa, 63, GS_FLOAT32);
  GS_EXPECT(gs_reduce_scatter(comm, &in63, o, 1, rows, GS_OP_SUM, 1.0, 1.0),
            GS_ERR_INVALID_ARGUMENT); /* 63 elements are 7 rows of 9, but out has 64 */
  CHECK_ERROR_MENTIONS("out[0]");
  rows[0] = 5; /* 63 is not a whole number of rows of 5 */
  GS_EXPECT(gs_reduce_scatter(comm, &in63, o, 1, rows, GS_OP_SUM, 1.0, 1.0),
            GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("rows");
  rows[0] = -1;
  GS_EXPECT(gs_reduce_scatter(comm, &in63, o, 1, rows, GS_OP_SUM, 1.0, 1.0),
            GS_ERR_INVALID_ARGUMENT);
  GS_EXPECT(gs_reduce_scatter(comm, t, NULL, 1, NULL, GS_OP_SUM, 1.0, 1.0),
            GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("out");
  UNTOUCHED(h);

  SECTION("allgather arguments");
  int64_t counts[64];
  int64_t row3[1] = {3};
  GS_EXPECT(gs_allgather_counts(comm, t, 1, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("counts_out");
  GS_EXPECT(gs_allgather_counts(comm, t, 1, row3, counts), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("rows of 3"); /* 64 is not a multiple of 3 */
  GS_EXPECT(gs_allgatherv(comm, t, o, 1, NULL), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("counts");
  for (int r = 0; r < size_; r++) counts[r] = NB;
  GS_EXPECT(gs_allgatherv(comm, t, o, 1, counts),
            size_ == 1 ? GS_SUCCESS : GS_ERR_INVALID_ARGUMENT);
  if (size_ > 1) CHECK_ERROR_MENTIONS("out[0]");
  fill_pattern();
  h = pattern_hash();
  counts[rank_] = NB - 1;
  GS_EXPECT(gs_allgatherv(comm, t, t, 1, counts), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("in[0]");
  UNTOUCHED(h);

  SECTION("shard arguments");
  gs_tensor_t mix[2] = {t[0], it};
  GS_EXPECT(gs_allgather_shards(comm, mix, 2), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("dtype");
  GS_EXPECT(gs_reduce_scatter_shards(comm, mix, 2, GS_OP_SUM, 1.0, 1.0), GS_ERR_TYPE);
  GS_EXPECT(gs_reduce_scatter_shards(comm, &it, 1, GS_OP_AVERAGE, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("average");
  if (size_ > 1) { /* tensor 0 (60 elements) passes rank 0's range */
    gs_tensor_t cross[2] = {GS_HOST_TENSOR(fa, 60, GS_FLOAT32), GS_HOST_TENSOR(fb, 10, GS_FLOAT32)};
    GS_EXPECT(gs_allgather_shards(comm, cross, 2), GS_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("a single rank must own the entire tensor");
    GS_EXPECT(gs_reduce_scatter_shards(comm, cross, 2, GS_OP_SUM, 1.0, 1.0),
              GS_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("gs_reduce_scatter_shards");
  }
  gs_shard_layout_t lay;
  GS_EXPECT(gs_shard_layout(NULL, 2, 2, &lay, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  int64_t c1[1] = {5};
  GS_EXPECT(gs_shard_layout(c1, 1, 0, &lay, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("size");
  GS_EXPECT(gs_shard_layout(c1, 1, 2, NULL, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  c1[0] = -1;
  GS_EXPECT(gs_shard_layout(c1, 1, 2, &lay, NULL, NULL), GS_ERR_INVALID_ARGUMENT);
  UNTOUCHED(h);

  check_comm_works(comm);
}

/* With validation off, argument errors are still reported locally. */
static void test_check_off(void) {
  SECTION("argument errors with validation off");
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.check = 0;
  gs_comm_t c = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &c));
  fill_pattern();
  uint64_t h = pattern_hash();
  gs_tensor_t bad = GS_HOST_TENSOR(fa, NB, (gs_dtype_t)99);
  GS_EXPECT(gs_allreduce(c, &bad, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TYPE);
  CHECK_ERROR_MENTIONS("dtype 99");
  GS_EXPECT(gs_allreduce(c, NULL, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  gs_tensor_t t = GS_HOST_TENSOR(fa, NB, GS_FLOAT32);
  GS_EXPECT(gs_broadcast(c, &t, 1, size_ + 3), GS_ERR_INVALID_ARGUMENT);
  CHECK_ERROR_MENTIONS("root");
  UNTOUCHED(h);
  check_comm_works(c);
  GS_OK(gs_comm_free(&c));
}

/* ---- disagreements across ranks (size >= 2) ------------------------------ */

/* Runs `call` on every rank: expects GS_ERR_MISMATCH everywhere, a message
 * mentioning each of the needles, and untouched buffers. */
#define EXPECT_MISMATCH(call, ...)                                       \
  do {                                                                   \
    fill_pattern();                                                      \
    uint64_t h_ = pattern_hash();                                        \
    GS_EXPECT((call), GS_ERR_MISMATCH);                                  \
    const char *needles_[] = {__VA_ARGS__};                              \
    for (size_t k_ = 0; k_ < sizeof needles_ / sizeof needles_[0]; k_++) \
      CHECK_ERROR_MENTIONS(needles_[k_]);                                \
    UNTOUCHED(h_);                                                       \
  } while (0)

static void test_mismatches(void) {
  if (size_ < 2) return;
  int last = size_ - 1;
  char other_ranks[32]; /* "1" or "1-3" */
  if (size_ == 2) snprintf(other_ranks, sizeof other_ranks, "rank(s) 1");
  else snprintf(other_ranks, sizeof other_ranks, "rank(s) 1-%d", last);

  gs_tensor_t t[3] = {GS_HOST_TENSOR(fa, NB, GS_FLOAT32), GS_HOST_TENSOR(fb, NB, GS_FLOAT32),
                      GS_HOST_TENSOR(fc, NB, GS_FLOAT32)};

  SECTION("mismatch: number of tensors");
  EXPECT_MISMATCH(gs_allreduce(comm, t, NULL, rank_ == 0 ? 3 : 2, GS_OP_SUM, 1.0, 1.0),
                  "number of tensors", "3 on rank(s) 0", other_ranks);

  SECTION("mismatch: dtype");
  {
    gs_tensor_t d[2] = {t[0], t[1]};
    if (rank_ == 1) d[1].dtype = GS_INT32; /* same bytes, other dtype */
    EXPECT_MISMATCH(gs_allreduce(comm, d, NULL, 2, GS_OP_MAX, 1.0, 1.0), "dtype of tensor 1",
                    "int32 on rank(s) 1", "float32");
  }

  SECTION("mismatch: element count");
  {
    gs_tensor_t d[3] = {t[0], t[1], t[2]};
    if (rank_ == last) d[2].count = NB - 1;
    EXPECT_MISMATCH(gs_allreduce(comm, d, NULL, 3, GS_OP_SUM, 1.0, 1.0),
                    "element count of tensor 2", "63", "64");
    EXPECT_MISMATCH(gs_broadcast(comm, d, 3, 0), "element count of tensor 2");
  }

  SECTION("mismatch: op");
  EXPECT_MISMATCH(gs_allreduce(comm, t, NULL, 2, rank_ == 0 ? GS_OP_SUM : GS_OP_MAX, 1.0, 1.0),
                  "the op", "sum on rank(s) 0", "max");

  SECTION("mismatch: the call tag (gs_set_call_options)");
  {
    gs_call_options_t o = {rank_ == 0 ? 0xabcdef0123456789ull : 0xabcdef0123456788ull, 0};
    GS_OK(gs_set_call_options(&o));
    EXPECT_MISMATCH(gs_allreduce(comm, t, NULL, 2, GS_OP_SUM, 1.0, 1.0), "the call tag",
                    "0xabcdef0123456789 on rank(s) 0", "0xabcdef0123456788");
    EXPECT_MISMATCH(gs_barrier(comm), "barrier: the call tag");
    gs_call_options_t now;
    gs_get_call_options(&now);
    CHECK(now.tag == o.tag, "the options last until set again");
    GS_OK(gs_set_call_options(NULL));
    gs_get_call_options(&now);
    CHECK(now.tag == 0 && now.timeout == 0, "NULL ends them");
    /* equal tags: the call runs */
    o.tag = 42;
    GS_OK(gs_set_call_options(&o));
    check_comm_works(comm);
    o.timeout = -1;
    GS_EXPECT(gs_set_call_options(&o), GS_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("timeout");
    gs_get_call_options(&now);
    CHECK(now.tag == 42 && now.timeout == 0, "a refused option changes nothing");
    GS_OK(gs_set_call_options(NULL));
  }

  SECTION("mismatch: root");
  EXPECT_MISMATCH(gs_broadcast(comm, t, 2, rank_ == 0 ? 0 : 1), "the root", "0 on rank(s) 0");

  SECTION("mismatch: the collective called");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_status_t got = rank_ == 0 ? gs_allreduce(comm, t, NULL, 1, GS_OP_SUM, 1.0, 1.0)
                                 : gs_broadcast(comm, t, 1, 0);
    CHECK(got == GS_ERR_MISMATCH, "got %d: %s", (int)got, gs_last_error());
    CHECK_ERROR_MENTIONS("allreduce");
    CHECK_ERROR_MENTIONS("broadcast");
    UNTOUCHED(h);
  }

  SECTION("mismatch: fusion threshold");
  {
    int64_t th = 0;
    GS_OK(gs_comm_fusion_threshold(comm, &th));
    GS_OK(gs_comm_set_fusion_threshold(comm, rank_ == last ? 4096 : th));
    EXPECT_MISMATCH(gs_allreduce(comm, t, NULL, 1, GS_OP_SUM, 1.0, 1.0), "fusion threshold");
    GS_OK(gs_comm_set_fusion_threshold(comm, th));
  }

  SECTION("mismatch: reduce_scatter rows");
  {
    int64_t rows[1] = {rank_ == 0 ? 16 : 32}; /* 64 elements either way */
    int64_t first, cnt;
    GS_OK(gs_block_range(rows[0], NB / rows[0], size_, rank_, &first, &cnt));
    gs_tensor_t out = GS_HOST_TENSOR(fc, cnt, GS_FLOAT32);
    EXPECT_MISMATCH(gs_reduce_scatter(comm, t, &out, 1, rows, GS_OP_SUM, 1.0, 1.0),
                    "number of rows");
  }

  SECTION("mismatch: allgather_counts dtype and row size");
  {
    int64_t counts[64];
    gs_tensor_t d[2] = {GS_HOST_TENSOR(fa, 4 * (rank_ + 1), GS_FLOAT32), t[1]};
    if (rank_ == last) d[1].dtype = GS_INT32;
    EXPECT_MISMATCH(gs_allgather_counts(comm, d, 2, NULL, counts), "dtype of tensor 1");
    d[1].dtype = GS_FLOAT32;
    int64_t row[2] = {rank_ == 0 ? 2 : 4, 1}; /* every count is a multiple of both */
    EXPECT_MISMATCH(gs_allgather_counts(comm, d, 2, row, counts), "row size");
    /* counts may differ by rank: that is the point of allgather_counts */
    GS_OK(gs_allgather_counts(comm, d, 2, NULL, counts));
    for (int r = 0; r < size_; r++)
      CHECK(counts[r * 2] == 4 * (r + 1) && counts[r * 2 + 1] == NB, "rank %d: %lld %lld", r,
            (long long)counts[r * 2], (long long)counts[r * 2 + 1]);
  }

  SECTION("mismatch: shard dtype");
  {
    gs_tensor_t d = GS_HOST_TENSOR(fa, 16, rank_ == 1 ? GS_INT32 : GS_FLOAT32);
    EXPECT_MISMATCH(gs_allgather_shards(comm, &d, 1), "dtype of tensor 0");
  }

  SECTION("argument error on one rank only: unknown dtype");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_tensor_t d[2] = {t[0], t[1]};
    if (rank_ == 1) d[0].dtype = (gs_dtype_t)99;
    gs_status_t s = gs_allreduce(comm, d, NULL, 2, GS_OP_SUM, 1.0, 1.0);
    if (rank_ == 1) {
      CHECK(s == GS_ERR_TYPE, "the failing rank gets its own status: %d (%s)", (int)s,
            gs_last_error());
      CHECK_ERROR_MENTIONS("dtype 99");
    } else {
      CHECK(s == GS_ERR_MISMATCH, "the other ranks get a mismatch: %d (%s)", (int)s,
            gs_last_error());
      CHECK_ERROR_MENTIONS("rank(s) 1");
      CHECK_ERROR_MENTIONS("dtype 99"); /* the failing rank's reason is passed on */
    }
    UNTOUCHED(h);
  }

  SECTION("argument error on one rank only: bad root");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_status_t s = gs_broadcast(comm, t, 2, rank_ == last ? size_ : 0);
    if (rank_ == last) {
      CHECK(s == GS_ERR_INVALID_ARGUMENT, "%d (%s)", (int)s, gs_last_error());
      CHECK_ERROR_MENTIONS("root");
    } else {
      CHECK(s == GS_ERR_MISMATCH, "%d (%s)", (int)s, gs_last_error());
      CHECK_ERROR_MENTIONS("root");
    }
    UNTOUCHED(h);
  }

  SECTION("argument error on one rank only: out overlaps in");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_tensor_t in1 = GS_HOST_TENSOR(fa, 32, GS_FLOAT32);
    gs_tensor_t out1 = GS_HOST_TENSOR(rank_ == 0 ? fa + 16 : fb, 32, GS_FLOAT32);
    gs_status_t s = gs_allreduce(comm, &in1, &out1, 1, GS_OP_SUM, 1.0, 1.0);
    CHECK(s == (rank_ == 0 ? GS_ERR_INVALID_ARGUMENT : GS_ERR_MISMATCH), "%d (%s)", (int)s,
          gs_last_error());
    CHECK_ERROR_MENTIONS("overlaps");
    UNTOUCHED(h);
  }

  SECTION("argument error on one rank only: average on int32");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_tensor_t d = rank_ == last ? GS_HOST_TENSOR(ia, NB, GS_INT32) : t[0];
    gs_status_t s = gs_allreduce(comm, &d, NULL, 1, GS_OP_AVERAGE, 1.0, 1.0);
    CHECK(s == (rank_ == last ? GS_ERR_TYPE : GS_ERR_MISMATCH), "%d (%s)", (int)s, gs_last_error());
    UNTOUCHED(h);
  }

  SECTION("gs_comm_abandon on one rank");
  {
    fill_pattern();
    uint64_t h = pattern_hash();
    gs_status_t s;
    if (rank_ == 0) s = gs_comm_abandon(comm, GS_ERR_TYPE, "my tensor is not contiguous");
    else s = gs_barrier(comm);
    CHECK(s == (rank_ == 0 ? GS_ERR_TYPE : GS_ERR_MISMATCH), "%d (%s)", (int)s, gs_last_error());
    CHECK_ERROR_MENTIONS("my tensor is not contiguous");
    if (rank_ == 0) s = gs_comm_abandon(comm, GS_ERR_INVALID_ARGUMENT, "bad shape");
    else s = gs_allreduce(comm, t, NULL, 1, GS_OP_SUM, 1.0, 1.0);
    CHECK(s == (rank_ == 0 ? GS_ERR_INVALID_ARGUMENT : GS_ERR_MISMATCH), "%d (%s)", (int)s,
          gs_last_error());
    CHECK_ERROR_MENTIONS("bad shape");
    UNTOUCHED(h);
  }

  SECTION("after the mismatches");
  check_comm_works(comm);
}

static void test_status_strings(void) {
  SECTION("gs_status_string");
  const char *seen[12];
  for (int s = 0; s <= GS_ERR_TIMEOUT; s++) {
    const char *str = gs_status_string((gs_status_t)s);
    CHECK(str && str[0], "status %d has no string", s);
    seen[s] = str ? str : "";
    for (int q = 0; q < s; q++)
      CHECK(strcmp(seen[q], seen[s]) != 0, "statuses %d and %d share the string \"%s\"", q, s,
            seen[s]);
  }
  CHECK(gs_status_string((gs_status_t)99) != NULL);
  CHECK(gs_status_string((gs_status_t)-1) != NULL);
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_errors");
  rank_ = gs_test_rank();
  size_ = gs_test_size();
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));
  test_status_strings();
  test_null_comm();
  test_comm_lifecycle();
  test_tensor_arguments();
  test_check_off();
  test_mismatches();
  GS_OK(gs_comm_free(&comm));
  return gs_test_finish();
}
