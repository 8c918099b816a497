/* The MPI transport: dtype and op mapping, float16/bfloat16 reductions as
 * user-defined ops accumulating in float32, and 64-bit counts split into
 * chunks that MPI's int counts can carry. */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gs_cuda.h"
#include "gs_internal.h"

/* Elements per MPI call. A power of two well below INT_MAX keeps every chunk
 * and byte offset of 8-byte types inside int. */
#define GS_MPI_CHUNK ((int64_t)1 << 30)

/* ---- MPI objects gradsync creates: its own reductions where MPI's would be
 * wrong (float16/bfloat16 math, NaN-propagating float min/max). Created on
 * first use, freed inside
 * MPI_Finalize through an attribute on MPI_COMM_SELF. */

#define USER_OP(name, dtype, op)                                         \
  static void name(void *in, void *inout, int *len, MPI_Datatype *dt) {  \
    (void)dt;                                                            \
    gs_cpu_reduce(dtype, op, in, inout, *len);                           \
  }
USER_OP(f16_sum, GS_FLOAT16, GS_OP_SUM)
USER_OP(f16_min, GS_FLOAT16, GS_OP_MIN)
USER_OP(f16_max, GS_FLOAT16, GS_OP_MAX)
USER_OP(f16_prod, GS_FLOAT16, GS_OP_PROD)
USER_OP(bf16_sum, GS_BFLOAT16, GS_OP_SUM)
USER_OP(bf16_min, GS_BFLOAT16, GS_OP_MIN)
USER_OP(bf16_max, GS_BFLOAT16, GS_OP_MAX)
USER_OP(bf16_prod, GS_BFLOAT16, GS_OP_PROD)
/* MPI_MIN/MPI_MAX leave NaN handling to the implementation; a NaN gradient
 * must survive a min/max reduction as it survives a sum. */
USER_OP(f32_min, GS_FLOAT32, GS_OP_MIN)
USER_OP(f32_max, GS_FLOAT32, GS_OP_MAX)
USER_OP(f64_min, GS_FLOAT64, GS_OP_MIN)
USER_OP(f64_max, GS_FLOAT64, GS_OP_MAX)

/* Indexed by dtype, then op (sum, -, min, max, prod); NULL: MPI's own op. */
static MPI_User_function *const user_fns[GS_NUM_DTYPES][GS_NUM_OPS] = {
    [GS_FLOAT16] = {f16_sum, NULL, f16_min, f16_max, f16_prod, NULL},
    [GS_BFLOAT16] = {bf16_sum, NULL, bf16_min, bf16_max, bf16_prod, NULL},
    [GS_FLOAT32] = {NULL, NULL, f32_min, f32_max, NULL, NULL},
    [GS_FLOAT64] = {NULL, NULL, f64_min, f64_max, NULL, NULL},
};
static MPI_Op user_ops[GS_NUM_DTYPES][GS_NUM_OPS];
static int objects_ready;
static pthread_mutex_t objects_lock = PTHREAD_MUTEX_INITIALIZER;

static int free_objects(MPI_Comm comm, int keyval, void *attr, void *extra) {
  (void)comm; (void)attr; (void)extra;
  for (int d = 0; d < GS_NUM_DTYPES; d++)
    for (int o = 0; o < GS_NUM_OPS; o++)
      if (user_fns[d][o]) MPI_Op_free(&user_ops[d][o]);
  objects_ready = 0;
  MPI_Comm_free_keyval(&keyval);
  return MPI_SUCCESS;
}

static gs_status_t ensure_objects(void) {
  if (__atomic_load_n(&objects_ready, __ATOMIC_ACQUIRE)) return GS_SUCCESS;
  pthread_mutex_lock(&objects_lock);
  int e = MPI_SUCCESS, keyval = MPI_KEYVAL_INVALID;
  if (!objects_ready) {
    for (int d = 0; d < GS_NUM_DTYPES && e == MPI_SUCCESS; d++)
      for (int o = 0; o < GS_NUM_OPS && e == MPI_SUCCESS; o++)
        if (user_fns[d][o]) e = MPI_Op_create(user_fns[d][o], 1, &user_ops[d][o]);
    if (e == MPI_SUCCESS)
      e = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_objects, &keyval, NULL);
    if (e == MPI_SUCCESS) e = MPI_Comm_set_attr(MPI_COMM_SELF, keyval, NULL);
    if (e == MPI_SUCCESS) __atomic_store_n(&objects_ready, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&objects_lock);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, "creating gradsync's MPI ops and types");
}

gs_status_t gs_mpi_datatype(gs_dtype_t dtype, MPI_Datatype *out) {
  switch (dtype) {
    case GS_FLOAT16:
    case GS_BFLOAT16: *out = MPI_UINT16_T; return GS_SUCCESS; /* bits; math in user ops */
    case GS_FLOAT32: *out = MPI_FLOAT; return GS_SUCCESS;
    case GS_FLOAT64: *out = MPI_DOUBLE; return GS_SUCCESS;
    case GS_INT8: *out = MPI_INT8_T; return GS_SUCCESS;
    case GS_UINT8: *out = MPI_UINT8_T; return GS_SUCCESS;
    case GS_INT32: *out = MPI_INT32_T; return GS_SUCCESS;
    case GS_INT64: *out = MPI_INT64_T; return GS_SUCCESS;
  }
  return gs_fail(GS_ERR_TYPE, "unknown dtype %d", (int)dtype);
}

gs_status_t gs_mpi_op(gs_dtype_t dtype, gs_op_t op, MPI_Op *out) {
  if (op == GS_OP_AVERAGE) op = GS_OP_SUM;
  if (!gs_dtype_valid(dtype) || (unsigned)op >= GS_NUM_OPS || gs_op_is_adasum(op))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "op %s has no MPI reduction", gs_op_name(op));
  if (user_fns[dtype][op]) {
    GS_CHECK(ensure_objects());
    *out = user_ops[dtype][op];
    return GS_SUCCESS;
  }
  static const MPI_Op builtin[GS_NUM_OPS] = {MPI_SUM, MPI_SUM, MPI_MIN, MPI_MAX, MPI_PROD,
                                             MPI_OP_NULL, MPI_OP_NULL};
  *out = builtin[op];
  return GS_SUCCESS;
}

/* ---- waiting ----------------------------------------------------------- */

int gs_use_blocking(gs_comm_t c, int64_t bytes) {
  /* A blocking call cannot time out, be interrupted, or let another thread
   * in while it waits: two threads each blocked in a call on their own
   * communicator, in opposite orders on two ranks, would wait for each
   * other forever. So only where MPI itself rules threads out. */
  static int single = -1;
  if (single < 0) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    single = level <= MPI_THREAD_FUNNELED;
  }
  return single && c->owns_core && bytes < GS_BLOCKING_MAX_BYTES &&
         gs_env_timeout_seconds() == 0.0;
}

/* Completes a call started either way: req == NULL means it was blocking. */
static gs_status_t finish(int e, MPI_Request *req, const char *what) {
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, what);
  return req ? gs_mpi_wait(req, what, NULL, NULL) : GS_SUCCESS;
}

/* gs_mpi_wait through the one wait loop. */
typedef struct mpi_wait {
  MPI_Request *req;
  const char *what;
  gs_wait_tick tick;
  void *ctx;
} mpi_wait_t;

static int mpi_poll(void *ctx, gs_status_t *err) {
  mpi_wait_t *m = ctx;
  int done = 0, e = MPI_Test(m->req, &done, MPI_STATUS_IGNORE);
  if (e != MPI_SUCCESS) {
    *err = gs_mpi_fail(e, m->what);
    return -1;
  }
  return done;
}

static void mpi_tick(void *ctx, double waited) {
  mpi_wait_t *m = ctx;
  int done = 0;
  m->tick(m->ctx, m->req, &done, waited); /* a completed request tests done next */
}

/* The request may point at memory the caller is about to release
 * (validation messages live on the stack), so it is cancelled (receives
 * cancel reliably) and given a moment to finish; one that will not is
 * released to MPI. */
static void mpi_cancel(void *ctx, gs_status_t why) {
  mpi_wait_t *m = ctx;
  (void)why;
  if (*m->req == MPI_REQUEST_NULL) return;
  MPI_Cancel(m->req);
  int done = 0;
  double until = gs_now() + 0.1;
  while (!done && gs_now() < until)
    if (MPI_Test(m->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
  if (!done && *m->req != MPI_REQUEST_NULL) MPI_Request_free(m->req);
}

gs_status_t gs_mpi_wait(MPI_Request *req, const char *what, gs_wait_tick tick, void *ctx) {
  mpi_wait_t m = {req, what, tick, ctx};
  gs_wait_t w = {mpi_poll, mpi_cancel, tick ? mpi_tick : NULL, NULL, &m, what};
  return gs_progress_wait(&w);
}

/* ---- chunked collectives ------------------------------------------------ */

/* One transport call is one fused message, however many chunks MPI needs. */
static void count_message(gs_comm_t c, int64_t count, gs_dtype_t dtype) {
  c->stats.messages++;
  c->stats.bytes += (uint64_t)count * gs_dtype_size(dtype);
}

#define RD_TAG 0x6772
#define RD_MAX_BYTES GS_BLOCKING_MAX_BYTES

/* Sends `bytes` of buf to `peer` and receives as many into `into`. */
static gs_status_t rd_swap(gs_comm_t c, const void *buf, void *into, int bytes, int peer,
                           int send, int recv) {
  MPI_Request r = MPI_REQUEST_NULL, s = MPI_REQUEST_NULL;
  if (recv) GS_MPI_CHECK(MPI_Irecv(into, bytes, MPI_BYTE, peer, RD_TAG, c->mpi, &r), "MPI_Irecv");
  if (send) GS_MPI_CHECK(MPI_Isend(buf, bytes, MPI_BYTE, peer, RD_TAG, c->mpi, &s), "MPI_Isend");
  if (recv) GS_CHECK(gs_mpi_wait(&r, "allreduce receive", NULL, NULL));
  if (send) GS_CHECK(gs_mpi_wait(&s, "allreduce send", NULL, NULL));
  return GS_SUCCESS;
}

/* Small allreduces as point-to-point recursive doubling, the shape of MPI's
 * own small-message allreduce but built on waits gradsync controls: as fast
 * as a blocking MPI_Allreduce (MPICH's MPI_Iallreduce costs about twice as
 * much at 4-64 KiB), while it can time out, be interrupted and let other
 * threads in. Ranks Q..P-1 fold into 0..P-Q-1 first and get the result
 * last; at every step both partners reduce lower into upper, so every rank
 * ends with the same bits. */
static gs_status_t rd_allreduce(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                gs_op_t op) {
  static _Thread_local unsigned char other[RD_MAX_BYTES] __attribute__((aligned(64)));
  int p = c->size, me = c->rank, q = 1;
  while (q * 2 <= p) q *= 2;
  int bytes = (int)(count * (int64_t)gs_dtype_size(dtype));
  if (me >= q) {
    GS_CHECK(rd_swap(c, buf, NULL, bytes, me - q, 1, 0));
    return rd_swap(c, NULL, buf, bytes, me - q, 0, 1);
  }
  if (me < p - q) {
    GS_CHECK(rd_swap(c, NULL, other, bytes, me + q, 0, 1));
    gs_cpu_reduce(dtype, op, buf, other, count); /* lower (me) into upper */
    memcpy(buf, other, (size_t)bytes);
  }
  for (int level = 1; level < q; level <<= 1) {
    int partner = me ^ level;
    GS_CHECK(rd_swap(c, buf, other, bytes, partner, 1, 1));
    if (me < partner) {
      gs_cpu_reduce(dtype, op, buf, other, count);
      memcpy(buf, other, (size_t)bytes);
    } else {
      gs_cpu_reduce(dtype, op, other, buf, count);
    }
  }
  if (me < p - q) GS_CHECK(rd_swap(c, buf, NULL, bytes, me + q, 1, 0));
  return GS_SUCCESS;
}

/* MPI's own allreduce, chunked: never touches the data itself, so device
 * pointers may go in when MPI is CUDA-aware and the op is MPI's. */
static gs_status_t native_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op);

static gs_status_t mpi_allreduce(gs_comm_t c, const void *send, void *recv,
                                 int64_t count, gs_dtype_t dtype, gs_op_t op) {
  count_message(c, count, dtype);
  if (count * (int64_t)gs_dtype_size(dtype) <= RD_MAX_BYTES &&
      !gs_use_blocking(c, count * (int64_t)gs_dtype_size(dtype))) {
    if (send) memcpy(recv, send, (size_t)count * gs_dtype_size(dtype));
    return rd_allreduce(c, recv, count, dtype, op);
  }
  return native_allreduce(c, send, recv, count, dtype, op);
}

static gs_status_t native_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  size_t es = gs_dtype_size(dtype);
  for (int64_t off = 0; off < count; off += GS_MPI_CHUNK) {
    int n = (int)(count - off < GS_MPI_CHUNK ? count - off : GS_MPI_CHUNK);
    char *r = (char *)recv + (size_t)off * es;
    const void *s = send ? (const char *)send + (size_t)off * es : MPI_IN_PLACE;
    MPI_Request req;
    if (gs_use_blocking(c, (int64_t)n * (int64_t)es))
      GS_CHECK(finish(MPI_Allreduce(s, r, n, dt, mop, c->mpi), NULL, "MPI_Allreduce"));
    else
      GS_CHECK(finish(MPI_Iallreduce(s, r, n, dt, mop, c->mpi, &req), &req, "MPI_Iallreduce"));
  }
  return GS_SUCCESS;
}

static gs_status_t chunked_bcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                 int root);

static gs_status_t mpi_broadcast(gs_comm_t c, void *buf, int64_t count,
                                 gs_dtype_t dtype, int root) {
  count_message(c, count, dtype);
  return chunked_bcast(c, buf, count, dtype, root);
}

static gs_status_t chunked_bcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                 int root) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  for (int64_t off = 0; off < count; off += GS_MPI_CHUNK) {
    int n = (int)(count - off < GS_MPI_CHUNK ? count - off : GS_MPI_CHUNK);
    MPI_Request req;
    char *p = (char *)buf + (size_t)off * es;
    if (gs_use_blocking(c, (int64_t)n * (int64_t)es))
      GS_CHECK(finish(MPI_Bcast(p, n, dt, root, c->mpi), NULL, "MPI_Bcast"));
    else
      GS_CHECK(finish(MPI_Ibcast(p, n, dt, root, c->mpi, &req), &req, "MPI_Ibcast"));
  }
  return GS_SUCCESS;
}

static int fits_int(const int64_t *v, int n) {
  for (int i = 0; i < n; i++)
    if (v[i] > INT_MAX) return 0;
  return 1;
}

static gs_status_t mpi_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                  const int64_t *displs, gs_dtype_t dtype) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  int p = c->size;
  count_message(c, displs[p - 1] + counts[p - 1], dtype);
  if (fits_int(counts, p) && fits_int(displs, p)) {
    int *ic = malloc(2 * (size_t)p * sizeof(int));
    if (!ic) return gs_fail(GS_ERR_NO_MEMORY, "allgather: out of memory");
    for (int r = 0; r < p; r++) { ic[r] = (int)counts[r]; ic[p + r] = (int)displs[r]; }
    MPI_Request req;
    gs_status_t s;
    if (gs_use_blocking(c, (displs[p - 1] + counts[p - 1]) * (int64_t)es))
      s = finish(MPI_Allgatherv(MPI_IN_PLACE, 0, dt, recv, ic, ic + p, dt, c->mpi), NULL,
                 "MPI_Allgatherv");
    else
      s = finish(MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, recv, ic, ic + p, dt, c->mpi, &req), &req,
                 "MPI_Iallgatherv");
    free(ic); /* only after completion: MPI reads the counts until then */
    return s;
  }
  /* Too large for int displacements: every rank broadcasts its own block. */
  for (int r = 0; r < p; r++)
    GS_CHECK(chunked_bcast(c, (char *)recv + (size_t)displs[r] * es, counts[r], dtype, r));
  return GS_SUCCESS;
}

static gs_status_t mpi_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                      const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  size_t es = gs_dtype_size(dtype);
  int p = c->size;
  int64_t total = 0;
  for (int r = 0; r < p; r++) total += counts[r];
  count_message(c, total, dtype);
  if (fits_int(counts, p) && total <= INT_MAX) {
    int *ic = malloc((size_t)p * sizeof(int));
    if (!ic) return gs_fail(GS_ERR_NO_MEMORY, "reduce_scatter: out of memory");
    for (int r = 0; r < p; r++) ic[r] = (int)counts[r];
    MPI_Request req;
    gs_status_t s;
    if (gs_use_blocking(c, total * (int64_t)es))
      s = finish(MPI_Reduce_scatter(send, recv, ic, dt, mop, c->mpi), NULL, "MPI_Reduce_scatter");
    else
      s = finish(MPI_Ireduce_scatter(send, recv, ic, dt, mop, c->mpi, &req), &req,
                 "MPI_Ireduce_scatter");
    free(ic);
    return s;
  }
  /* Large: reduce each rank's block to that rank, chunk by chunk. */
  int64_t displ = 0;
  for (int r = 0; r < p; r++) {
    for (int64_t off = 0; off < counts[r]; off += GS_MPI_CHUNK) {
      int n = (int)(counts[r] - off < GS_MPI_CHUNK ? counts[r] - off : GS_MPI_CHUNK);
      const char *s = (const char *)send + (size_t)(displ + off) * es;
      void *d = r == c->rank ? (char *)recv + (size_t)off * es : NULL;
      MPI_Request req;
      GS_CHECK(finish(MPI_Ireduce(s, d, n, dt, mop, r, c->mpi, &req), &req, "MPI_Ireduce"));
    }
    displ += counts[r];
  }
  return GS_SUCCESS;
}

/* ---- CUDA-aware MPI ---------------------------------------------------------- */

int gs_mpi_op_is_builtin(gs_dtype_t dtype, gs_op_t op) {
  if (op == GS_OP_AVERAGE) op = GS_OP_SUM;
  return gs_dtype_valid(dtype) && (unsigned)op < GS_NUM_OPS && !gs_op_is_adasum(op) &&
         user_fns[dtype][op] == NULL;
}

int gs_mpi_cuda_aware(void) {
  static int known = -1;
  if (known >= 0) return known;
  const char *env = getenv("GRADSYNC_CUDA_AWARE_MPI");
  if (env && *env) return known = (strcmp(env, "0") != 0);
  known = 0;
#if defined(MPIX_GPU_SUPPORT_CUDA)
  int yes = 0; /* MPICH 4+: asks the library as built and configured */
  if (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &yes) == MPI_SUCCESS) known = yes != 0;
#endif
  return known;
}

/* Device buffers straight into MPI: data movement always; reductions when
 * the op is MPI's own (gradsync's float16/bfloat16 and NaN-aware min/max ops
 * run on the host, so those go through pinned staging instead). */
/* MPI reads device memory itself: the kernels queued before (packing) must
 * have finished first. */
static gs_status_t device_ready(gs_comm_t c) {
  return c->dev_stream ? gs_cu_stream_wait(c->dev_stream, "gradsync: before CUDA-aware MPI")
                       : GS_SUCCESS;
}

static gs_status_t aware_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                   gs_dtype_t dtype, gs_op_t op) {
  if (!gs_mpi_op_is_builtin(dtype, op))
    return gs_staged_transport.allreduce(c, send, recv, count, dtype, op);
  GS_CHECK(device_ready(c));
  count_message(c, count, dtype);
  return native_allreduce(c, send, recv, count, dtype, op);
}

static gs_status_t aware_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                   int root) {
  GS_CHECK(device_ready(c));
  return mpi_broadcast(c, buf, count, dtype, root);
}

static gs_status_t aware_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                    const int64_t *displs, gs_dtype_t dtype) {
  GS_CHECK(device_ready(c));
  return mpi_allgatherv(c, recv, counts, displs, dtype);
}

static gs_status_t aware_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                        const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  if (!gs_mpi_op_is_builtin(dtype, op))
    return gs_staged_transport.reduce_scatter(c, send, recv, counts, dtype, op);
  GS_CHECK(device_ready(c));
  return mpi_reduce_scatter(c, send, recv, counts, dtype, op);
}

const gs_transport_t gs_cuda_aware_transport = {
    "mpi-cuda-aware", aware_allreduce, aware_broadcast, aware_allgatherv, aware_reduce_scatter,
    gs_staged_poll, NULL, NULL,
};

const gs_transport_t gs_mpi_transport = {
    "mpi", mpi_allreduce, mpi_broadcast, mpi_allgatherv, mpi_reduce_scatter, NULL, NULL, NULL,
};
