/* The NCCL transport. NCCL is opened at run time (GRADSYNC_NCCL_LIBRARY, the
 * library found at build time, then libnccl.so.2 on the loader's path), so
 * one build runs on machines with and without it; only its header is needed
 * to compile. NCCL older than 2.14 is refused (no non-blocking communicators
 * to poll; bf16 came in 2.10), and the device path then stages through MPI.
 *
 * Nothing here blocks: communicators are created non-blocking and every NCCL
 * call that reports ncclInProgress is polled to completion through
 * gs_progress_wait, as is the work on the stream (the engine polls the
 * transport) and ncclCommFinalize at close (ncclCommDestroy then only frees
 * memory). A wait that gives up (GRADSYNC_TIMEOUT_SECONDS, an interrupt)
 * or an asynchronous NCCL error aborts the NCCL communicator, never
 * destroys it; the gradsync communicator is then unusable and the message
 * carries ncclGetLastError. The abort itself runs once the runtime lock is
 * released (it may take seconds; other threads' calls go on meanwhile):
 * under the lock the handle is only taken out of the communicator, so every
 * later poll, which runs under the lock, sees it gone and never touches a
 * communicator NCCL is freeing.
 *
 * NCCL's min and max drop NaN (fmin/fmax); gradsync's propagate it on every
 * path, so float min/max go over NCCL as an integer min/max of order keys
 * (cuda_pieces.cuh) that keep NaN winning. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gs_info.h"
#include "transport/gs_transport.h"

#ifndef GS_NCCL_LIBRARY
#define GS_NCCL_LIBRARY ""
#endif

#ifdef GS_HAVE_NCCL
#include <nccl.h>

#define MIN_VERSION 21400 /* NCCL 2.14: ncclCommInitRankConfig with blocking = 0 */

/* The NCCL entry points gradsync opens (clang-format cannot settle on a
 * layout for this list). */
// clang-format off
#define NCCL_FUNCTIONS(X) \
  X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommFinalize) \
  X(ncclCommDestroy) \
  X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclGetErrorString) X(ncclGetLastError) \
  X(ncclAllReduce) X(ncclBroadcast) X(ncclAllGather) X(ncclReduceScatter) X(ncclReduce) \
  X(ncclSend) X(ncclRecv) X(ncclGroupStart) X(ncclGroupEnd)
// clang-format on

static struct {
#define NCCL_POINTER(name) __typeof__(name) *name;
  NCCL_FUNCTIONS(NCCL_POINTER)
#undef NCCL_POINTER
  void *handle;
  int version;
  char error[512];
} api;
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void refuse(const char *why) {
  snprintf(api.error, sizeof api.error, "%s", why);
  dlclose(api.handle);
  api.handle = NULL;
}

static void open_library(void) {
  const char *env = gs_env_nccl_library();
  const char *candidates[] = {env, GS_NCCL_LIBRARY, "libnccl.so.2", "libnccl.so"};
  for (size_t k = 0; k < sizeof candidates / sizeof *candidates && !api.handle; k++)
    if (candidates[k] && *candidates[k]) api.handle = dlopen(candidates[k], RTLD_NOW | RTLD_LOCAL);
  if (!api.handle) {
    snprintf(api.error, sizeof api.error,
             "cannot open NCCL (set GRADSYNC_NCCL_LIBRARY, or "
             "install nvidia-nccl-cu13): %s",
             dlerror());
    return;
  }
  if (!(api.ncclGetVersion = (__typeof__(ncclGetVersion) *)dlsym(api.handle, "ncclGetVersion")) ||
      api.ncclGetVersion(&api.version) != ncclSuccess || api.version < MIN_VERSION) {
    char why[256];
    snprintf(why, sizeof why,
             "NCCL %d.%d.%d is older than 2.14, the oldest gradsync uses "
             "(non-blocking communicators, bfloat16); device collectives use MPI",
             api.version / 10000, api.version / 100 % 100, api.version % 100);
    refuse(why);
    return;
  }
#define NCCL_LOAD(name)                                             \
  if (!(api.name = (__typeof__(name) *)dlsym(api.handle, #name))) { \
    refuse("the NCCL library lacks " #name);                        \
    return;                                                         \
  }
  NCCL_FUNCTIONS(NCCL_LOAD)
#undef NCCL_LOAD
}

int gs_nccl_loadable(void) {
  pthread_once(&api_once, open_library);
  if (!api.handle && (gs_env_debug_nccl() || gs_log_level() >= GS_LOG_INFO))
    gs_log(GS_LOG_INFO, "%s", api.error);
  return api.handle != NULL;
}

int gs_nccl_version(void) { return gs_nccl_loadable() ? api.version : 0; }

/* NCCL's words on the communicator's last error. */
static const char *last_error(gs_comm_t c) {
  const char *s = api.handle ? api.ncclGetLastError(c ? (ncclComm_t)c->nccl : NULL) : NULL;
  return s ? s : "";
}

static gs_status_t nccl_fail(gs_comm_t c, ncclResult_t r, const char *what) {
  const char *last = last_error(c);
  return gs_fail(GS_ERR_NCCL, "%s: %s%s%s", what, api.ncclGetErrorString(r), *last ? ": " : "",
                 last);
}

/* ---- polling a non-blocking communicator ------------------------------------------ */

typedef struct detached {
  ncclComm_t comm;
  int device;
} detached_t;

/* Outside the runtime lock, on the communicator's device. */
static void abort_detached(void *arg) {
  detached_t *d = arg;
  gs_cu_scope_t scope;
  int entered = gs_cu_enter(d->device, &scope) == GS_SUCCESS;
  api.ncclCommAbort(d->comm); /* ends its kernels; the handle is gone */
  if (entered) gs_cu_leave(&scope);
  free(d);
}

/* Under the runtime lock: the handle leaves c now (later polls see it gone),
 * the abort runs once this thread releases the lock. */
static void abort_comm(gs_comm_t c, gs_status_t why) {
  if (!c->nccl) return;
  gs_log(GS_LOG_ERROR, "aborting the NCCL communicator (%s)", gs_status_string(why));
  detached_t *d = malloc(sizeof *d);
  ncclComm_t comm = (ncclComm_t)c->nccl;
  c->nccl = NULL;
  if (!d) {
    api.ncclCommAbort(comm); /* out of memory: at once */
    return;
  }
  d->comm = comm;
  d->device = c->dev_id;
  gs_runtime_after_unlock(abort_detached, d);
}

static const char *detail(gs_comm_t c) { return c->nccl ? last_error(c) : NULL; }

/* A poll of a communicator that another wait has aborted (the background
 * watcher polls handed-off requests while a caller may wait on the same
 * one): it reports that wait's reason, so whichever poll finishes the
 * request, it fails the same way (a timeout stays a timeout). -1. */
static int aborted_already(gs_comm_t c, const char *what, gs_status_t *err) {
  gs_status_t why = c->fate.broken ? c->fate.broken : GS_ERR_NCCL;
  *err = gs_fail(why, "%s: the NCCL communicator was aborted: %s", what, gs_status_string(why));
  return -1;
}

typedef struct settle_ctx {
  gs_comm_t c;
  const char *what;
} settle_ctx_t;

static int settle_poll(void *ctx, gs_status_t *err) {
  settle_ctx_t *s = ctx;
  if (!s->c->nccl) return aborted_already(s->c, s->what, err);
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = api.ncclCommGetAsyncError((ncclComm_t)s->c->nccl, &state);
  if (r == ncclSuccess && state == ncclInProgress) return 0;
  if (r == ncclSuccess && state == ncclSuccess) return 1;
  *err = nccl_fail(s->c, r != ncclSuccess ? r : state, s->what);
  abort_comm(s->c, GS_ERR_NCCL);
  s->c->fate.broken = GS_ERR_NCCL;
  return -1;
}

static void settle_abort(void *ctx, gs_status_t why) { abort_comm(((settle_ctx_t *)ctx)->c, why); }
static const char *settle_detail(void *ctx) { return detail(((settle_ctx_t *)ctx)->c); }

/* A call on a non-blocking communicator: ncclInProgress is polled until the
 * call is done (its enqueue, not its kernel); any error aborts. */
static gs_status_t settle(gs_comm_t c, ncclResult_t r, const char *what) {
  if (r == ncclSuccess) return GS_SUCCESS;
  if (r != ncclInProgress) {
    gs_status_t s = nccl_fail(c, r, what);
    abort_comm(c, GS_ERR_NCCL);
    c->fate.broken = GS_ERR_NCCL;
    return s;
  }
  settle_ctx_t ctx = {c, what};
  gs_wait_t w = {settle_poll, settle_abort, NULL, settle_detail, &ctx, what};
  return gs_progress_wait(&w);
}

#define NCCL_CALL(c, call, what) GS_CHECK(settle((c), (call), (what)))

static int nccl_poll(gs_comm_t c, void *event, const char *what, gs_status_t *err) {
  if (!c->nccl) return aborted_already(c, what, err);
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = api.ncclCommGetAsyncError((ncclComm_t)c->nccl, &state);
  if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    char said[160];
    snprintf(said, sizeof said, "%s: NCCL reported an asynchronous error", what);
    *err = nccl_fail(c, r != ncclSuccess ? r : state, said);
    abort_comm(c, GS_ERR_NCCL);
    c->fate.broken = GS_ERR_NCCL;
    return -1;
  }
  int done = gs_cu_event_poll(event, what);
  if (done < 0) *err = GS_ERR_CUDA;
  return done;
}

/* ---- communicators ---------------------------------------------------------------------- */

/* The 2.14 layout of ncclConfig_t (fields are only appended): NCCL reads as
 * many bytes as `size` says, so this works with every NCCL from 2.14 on,
 * whichever nccl.h gradsync was built with. */
typedef struct config_2_14 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char *netName;
  int splitShare;
} config_2_14_t;

gs_status_t gs_nccl_comm_init(gs_comm_t c) {
  if (!gs_nccl_loadable()) return gs_fail(GS_ERR_UNSUPPORTED, "%s", api.error);
  /* rank 0's id, and whether it has one (it broadcasts even after a failure,
   * so nobody waits); on the heap and kept if the wait gives up, as MPI may
   * still complete the broadcast into it */
  struct {
    ncclUniqueId id;
    int ok;
  } *boot = calloc(1, sizeof *boot);
  if (!boot) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  gs_status_t s = GS_SUCCESS;
  if (c->rank == 0) {
    ncclResult_t r = api.ncclGetUniqueId(&boot->id);
    if (r != ncclSuccess) s = nccl_fail(NULL, r, "ncclGetUniqueId");
  }
  boot->ok = s == GS_SUCCESS;
  MPI_Request req;
  GS_CHECK(gs_mpi_finish(MPI_Ibcast(boot, (int)sizeof *boot, MPI_BYTE, 0, c->mpi, &req), &req,
                         "gradsync: NCCL bootstrap (MPI_Ibcast)"));
  ncclUniqueId id = boot->id;
  int ok = boot->ok;
  free(boot);
  if (!ok) return s != GS_SUCCESS ? s : gs_fail(GS_ERR_NCCL, "ncclGetUniqueId failed on rank 0");
#ifndef NCCL_API_MAGIC /* headers before 2.30 write the magic out */
#define NCCL_API_MAGIC 0xcafebeef
#endif
  config_2_14_t cfg = {sizeof cfg,
                       NCCL_API_MAGIC,
                       MIN_VERSION,
                       0,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_PTR,
                       NCCL_CONFIG_UNDEF_INT};
  ncclComm_t comm = NULL;
  ncclResult_t r = api.ncclCommInitRankConfig(&comm, c->size, id, c->rank, (ncclConfig_t *)&cfg);
  c->nccl = comm;
  if (r != ncclSuccess && r != ncclInProgress) {
    s = nccl_fail(c, r, "ncclCommInitRankConfig");
    if (comm) api.ncclCommAbort(comm);
    c->nccl = NULL;
    return s;
  }
  s = settle(c, r, "ncclCommInitRankConfig"); /* polls the initialization */
  if (s != GS_SUCCESS) {
    abort_comm(c, s);
    if (s == GS_ERR_INTERRUPTED) { /* the interrupt goes up; c is unusable */
      c->fate.broken = s;
      return s;
    }
    c->fate.broken = GS_SUCCESS; /* the ranks agree on a fallback in choose_path */
    if (s == GS_ERR_TIMEOUT)
      s = gs_fail(s,
                  "ncclCommInitRankConfig did not complete within "
                  "GRADSYNC_TIMEOUT_SECONDS=%g s (NCCL's bootstrap did not reach every rank)",
                  gs_env_timeout_seconds());
  }
  return s;
}

/* At close, after the communicator's last work on its stream has finished:
 * ncclCommFinalize, polled like every wait (GRADSYNC_TIMEOUT_SECONDS,
 * interrupts), then ncclCommDestroy, which has nothing left to wait for. A
 * finalize that fails or gives up aborts instead (settle), and c is then
 * unusable. ncclCommDestroy alone would finalize first, blocking without
 * bound. */
gs_status_t gs_nccl_comm_free(gs_comm_t c) {
  if (!c->nccl || !api.handle) {
    c->nccl = NULL;
    return GS_SUCCESS;
  }
  gs_fate_t *saved = gs_runtime_bind(&c->fate); /* a finalize that gives up marks c */
  gs_status_t s = settle(c, api.ncclCommFinalize((ncclComm_t)c->nccl), "ncclCommFinalize");
  gs_runtime_bind(saved);
  if (s == GS_SUCCESS && c->nccl) api.ncclCommDestroy((ncclComm_t)c->nccl);
  c->nccl = NULL;
  return s;
}

/* ---- the collectives ---------------------------------------------------------------------- */

static ncclDataType_t nccl_type(gs_dtype_t d) {
  switch (d) {
    case GS_FLOAT16: return ncclFloat16;
    case GS_BFLOAT16: return ncclBfloat16;
    case GS_FLOAT32: return ncclFloat32;
    case GS_FLOAT64: return ncclFloat64;
    case GS_INT8: return ncclInt8;
    case GS_UINT8: return ncclUint8;
    case GS_INT32: return ncclInt32;
    default: return ncclInt64;
  }
}

static ncclRedOp_t nccl_op(gs_op_t op) {
  switch (op) {
    case GS_OP_MIN: return ncclMin;
    case GS_OP_MAX: return ncclMax;
    case GS_OP_PROD: return ncclProd;
    default: return ncclSum; /* average: sum, scaled by the engine */
  }
}

#define COMM(c) ((ncclComm_t)(c)->nccl)
#define STREAM(c) ((cudaStream_t)(c)->dev_stream)

/* One rank reduces nothing: its data passes unchanged, as on every path. */
static int keyed(gs_comm_t c, gs_dtype_t dtype, gs_op_t op) {
  return c->size > 1 && (op == GS_OP_MIN || op == GS_OP_MAX) && gs_dtype_is_float(dtype);
}

static ncclDataType_t key_type(gs_dtype_t dtype) {
  return gs_cu_key_bytes(dtype) == 8 ? ncclUint64 : ncclUint32;
}

/* Scratch for keys: `elements` of them. */
static gs_status_t key_scratch(gs_comm_t c, int64_t elements, gs_dtype_t dtype, char **keys) {
  GS_CHECK(gs_cu_grow(&c->dev_keys, &c->dev_keys_bytes,
                      (size_t)elements * (size_t)gs_cu_key_bytes(dtype), c->dev_stream));
  *keys = c->dev_keys;
  return GS_SUCCESS;
}

static gs_status_t to_keys(gs_comm_t c, gs_dtype_t dtype, gs_op_t op, const void *src, void *keys,
                           int64_t n, int inverse) {
  return gs_cu_launched(
      gs_cu_launch_order_keys((int)dtype, op == GS_OP_MAX, inverse, src, keys, n, c->dev_stream),
      "gradsync: min/max order-key kernel launch");
}

static gs_status_t nccl_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                  gs_dtype_t dtype, gs_op_t op) {
  const void *src = send ? send : recv;
  if (!keyed(c, dtype, op)) {
    NCCL_CALL(c,
              api.ncclAllReduce(src, recv, (size_t)count, nccl_type(dtype), nccl_op(op), COMM(c),
                                STREAM(c)),
              "ncclAllReduce");
    return GS_SUCCESS;
  }
  char *keys = recv; /* 32- and 64-bit floats: keys of their own width, in place */
  if ((size_t)gs_cu_key_bytes(dtype) != gs_dtype_size(dtype))
    GS_CHECK(key_scratch(c, count, dtype, &keys));
  GS_CHECK(to_keys(c, dtype, op, src, keys, count, 0));
  NCCL_CALL(c,
            api.ncclAllReduce(keys, keys, (size_t)count, key_type(dtype), nccl_op(op), COMM(c),
                              STREAM(c)),
            "ncclAllReduce (min/max order keys)");
  return to_keys(c, dtype, op, keys, recv, count, 1);
}

static gs_status_t nccl_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                  int root) {
  NCCL_CALL(c,
            api.ncclBroadcast(buf, buf, (size_t)count, nccl_type(dtype), root, COMM(c), STREAM(c)),
            "ncclBroadcast");
  return GS_SUCCESS;
}

static int equal_blocks(gs_comm_t c, const int64_t *counts, const int64_t *displs) {
  for (int r = 0; r < c->size; r++)
    if (counts[r] != counts[0] || (displs && displs[r] != r * counts[0])) return 0;
  return 1;
}

/* Equal blocks: one ncclAllGather. Otherwise every rank broadcasts its
 * block, all in one group (NCCL runs them as one operation). */
static gs_status_t nccl_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                   const int64_t *displs, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  if (equal_blocks(c, counts, displs)) {
    char *mine = (char *)recv + (size_t)displs[c->rank] * es;
    NCCL_CALL(
        c, api.ncclAllGather(mine, recv, (size_t)counts[0], nccl_type(dtype), COMM(c), STREAM(c)),
        "ncclAllGather");
    return GS_SUCCESS;
  }
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int root = 0; root < c->size && (r == ncclSuccess || r == ncclInProgress); root++) {
    char *block = (char *)recv + (size_t)displs[root] * es;
    if (counts[root])
      r = api.ncclBroadcast(block, block, (size_t)counts[root], nccl_type(dtype), root, COMM(c),
                            STREAM(c));
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return settle(c, r, "ncclBroadcast (allgatherv)");
  NCCL_CALL(c, g, "ncclGroupEnd (allgatherv)");
  return GS_SUCCESS;
}

/* Equal blocks: one ncclReduceScatter. Otherwise one ncclReduce per block,
 * rooted at its owner, in one group. Elements of `type`, `size` bytes each. */
static gs_status_t reduce_blocks(gs_comm_t c, const void *send, void *recv, const int64_t *counts,
                                 ncclDataType_t type, size_t size, ncclRedOp_t op) {
  if (equal_blocks(c, counts, NULL)) {
    NCCL_CALL(c, api.ncclReduceScatter(send, recv, (size_t)counts[0], type, op, COMM(c), STREAM(c)),
              "ncclReduceScatter");
    return GS_SUCCESS;
  }
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  size_t off = 0;
  for (int root = 0; root < c->size && (r == ncclSuccess || r == ncclInProgress); root++) {
    if (counts[root])
      r = api.ncclReduce((const char *)send + off, recv, (size_t)counts[root], type, op, root,
                         COMM(c), STREAM(c));
    off += (size_t)counts[root] * size;
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return settle(c, r, "ncclReduce (reduce_scatter)");
  NCCL_CALL(c, g, "ncclGroupEnd (reduce_scatter)");
  return GS_SUCCESS;
}

static gs_status_t nccl_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                       const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  if (!keyed(c, dtype, op))
    return reduce_blocks(c, send, recv, counts, nccl_type(dtype), gs_dtype_size(dtype),
                         nccl_op(op));
  int64_t total = 0, mine = counts[c->rank];
  for (int r = 0; r < c->size; r++) total += counts[r];
  char *keys;
  size_t kb = (size_t)gs_cu_key_bytes(dtype);
  GS_CHECK(key_scratch(c, total + mine, dtype, &keys));
  GS_CHECK(to_keys(c, dtype, op, send, keys, total, 0));
  GS_CHECK(
      reduce_blocks(c, keys, keys + (size_t)total * kb, counts, key_type(dtype), kb, nccl_op(op)));
  return to_keys(c, dtype, op, keys + (size_t)total * kb, recv, mine, 1);
}

static gs_status_t nccl_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                 int64_t rcount, gs_dtype_t dtype, int peer) {
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  if (scount) r = api.ncclSend(sbuf, (size_t)scount, nccl_type(dtype), peer, COMM(c), STREAM(c));
  if ((r == ncclSuccess || r == ncclInProgress) && rcount)
    r = api.ncclRecv(rbuf, (size_t)rcount, nccl_type(dtype), peer, COMM(c), STREAM(c));
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return settle(c, r, "ncclSend/ncclRecv");
  NCCL_CALL(c, g, "ncclGroupEnd (exchange)");
  return GS_SUCCESS;
}

/* One group for every peer: NCCL schedules the sends and receives
 * together, where pairwise groups would run one round after another. */
static gs_status_t nccl_alltoallv(gs_comm_t c, const void *send, const int64_t *scounts,
                                  const int64_t *sdispls, void *recv, const int64_t *rcounts,
                                  const int64_t *rdispls, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int k = 1; k < c->size && (r == ncclSuccess || r == ncclInProgress); k++) {
    int to = (c->rank + k) % c->size, from = (c->rank - k + c->size) % c->size;
    if (scounts[to])
      r = api.ncclSend((const char *)send + (size_t)sdispls[to] * es, (size_t)scounts[to],
                       nccl_type(dtype), to, COMM(c), STREAM(c));
    if ((r == ncclSuccess || r == ncclInProgress) && rcounts[from])
      r = api.ncclRecv((char *)recv + (size_t)rdispls[from] * es, (size_t)rcounts[from],
                       nccl_type(dtype), from, COMM(c), STREAM(c));
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return settle(c, r, "ncclSend/ncclRecv (alltoallv)");
  NCCL_CALL(c, g, "ncclGroupEnd (alltoallv)");
  return GS_SUCCESS;
}

const gs_transport_t gs_nccl_transport = {
    "nccl",        nccl_allreduce, nccl_broadcast, nccl_allgatherv, nccl_reduce_scatter,
    nccl_exchange, nccl_poll,      abort_comm,     detail,          NULL,
    nccl_alltoallv,
};

#else /* no NCCL header at build time */

int gs_nccl_loadable(void) { return 0; }
int gs_nccl_version(void) { return 0; }
gs_status_t gs_nccl_comm_init(gs_comm_t c) {
  (void)c;
  return gs_fail(GS_ERR_UNSUPPORTED, "gradsync was built without NCCL");
}
gs_status_t gs_nccl_comm_free(gs_comm_t c) {
  c->nccl = NULL;
  return GS_SUCCESS;
}
/* Never chosen: the engine takes NCCL only where gs_nccl_loadable() says so. */
const gs_transport_t gs_nccl_transport = {.name = "nccl"};
#endif
