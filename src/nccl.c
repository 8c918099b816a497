/* The NCCL backend. NCCL is opened at run time (GRADSYNC_NCCL_LIBRARY, the
 * library found at build time, then libnccl.so.2 on the loader's path), so
 * one build runs on machines with and without it; only its header is needed
 * to compile. One NCCL communicator per gradsync communicator, bootstrapped
 * by broadcasting rank 0's unique id over MPI. Calls queue on gradsync's
 * stream; the engine waits at the end of the call. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gs_cuda.h"
#include "gs_internal.h"

#ifndef GS_NCCL_LIBRARY
#define GS_NCCL_LIBRARY ""
#endif

#ifdef GS_HAVE_NCCL
#include <nccl.h>

#define NCCL_FUNCTIONS(X)                                                              \
  X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclCommDestroy)            \
  X(ncclCommAbort) X(ncclGetErrorString) X(ncclAllReduce) X(ncclBroadcast)               \
  X(ncclAllGather) X(ncclReduceScatter) X(ncclReduce) X(ncclSend) X(ncclRecv)            \
  X(ncclGroupStart) X(ncclGroupEnd)

static struct {
#define NCCL_POINTER(name) __typeof__(name) *name;
  NCCL_FUNCTIONS(NCCL_POINTER)
#undef NCCL_POINTER
  void *handle;
  char error[512];
} api;
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void open_library(void) {
  const char *env = getenv("GRADSYNC_NCCL_LIBRARY");
  const char *candidates[] = {env, GS_NCCL_LIBRARY, "libnccl.so.2", "libnccl.so"};
  for (size_t k = 0; k < sizeof candidates / sizeof *candidates && !api.handle; k++)
    if (candidates[k] && *candidates[k]) api.handle = dlopen(candidates[k], RTLD_NOW | RTLD_LOCAL);
  if (!api.handle) {
    snprintf(api.error, sizeof api.error, "cannot open NCCL (set GRADSYNC_NCCL_LIBRARY, or "
             "install nvidia-nccl-cu13): %s", dlerror());
    return;
  }
#define NCCL_LOAD(name)                                                         \
  if (!(api.name = (__typeof__(name) *)dlsym(api.handle, #name))) {            \
    snprintf(api.error, sizeof api.error, "the NCCL library lacks %s", #name); \
    dlclose(api.handle);                                                        \
    api.handle = NULL;                                                          \
    return;                                                                     \
  }
  NCCL_FUNCTIONS(NCCL_LOAD)
#undef NCCL_LOAD
}

int gs_nccl_loadable(void) {
  pthread_once(&api_once, open_library);
  if (!api.handle && (getenv("GRADSYNC_DEBUG_NCCL") || gs_log_level() >= GS_LOG_INFO))
    gs_log(GS_LOG_INFO, "%s", api.error);
  return api.handle != NULL;
}

int gs_nccl_version(void) {
  int v = 0;
  if (!gs_nccl_loadable() || api.ncclGetVersion(&v) != ncclSuccess) return 0;
  return v;
}

static gs_status_t nccl_fail(ncclResult_t r, const char *what) {
  return gs_fail(GS_ERR_NCCL, "%s: %s", what, api.ncclGetErrorString(r));
}

#define NCCL_CHECK(call, what)                              \
  do {                                                      \
    ncclResult_t nccl_r_ = (call);                          \
    if (nccl_r_ != ncclSuccess) return nccl_fail(nccl_r_, (what)); \
  } while (0)

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

gs_status_t gs_nccl_comm_init(gs_comm_t c) {
  if (!gs_nccl_loadable()) return gs_fail(GS_ERR_UNSUPPORTED, "%s", api.error);
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  gs_status_t s = GS_SUCCESS;
  if (c->rank == 0) {
    ncclResult_t r = api.ncclGetUniqueId(&id);
    if (r != ncclSuccess) s = nccl_fail(r, "ncclGetUniqueId");
  }
  /* rank 0 broadcasts the id even after a failure, so nobody waits; a zero
   * id then fails everywhere in ncclCommInitRank's place below */
  int ok = s == GS_SUCCESS;
  GS_MPI_CHECK(MPI_Bcast(&ok, 1, MPI_INT, 0, c->mpi), "gradsync: NCCL bootstrap");
  GS_MPI_CHECK(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, c->mpi), "gradsync: NCCL bootstrap");
  if (!ok) return s != GS_SUCCESS ? s : gs_fail(GS_ERR_NCCL, "ncclGetUniqueId failed on rank 0");
  ncclComm_t comm = NULL;
  NCCL_CHECK(api.ncclCommInitRank(&comm, c->size, id, c->rank), "ncclCommInitRank");
  c->nccl = comm;
  return GS_SUCCESS;
}

void gs_nccl_comm_free(gs_comm_t c) {
  if (c->nccl && api.handle) api.ncclCommDestroy((ncclComm_t)c->nccl);
  c->nccl = NULL;
}

static gs_status_t nccl_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                  gs_dtype_t dtype, gs_op_t op) {
  NCCL_CHECK(api.ncclAllReduce(send ? send : recv, recv, (size_t)count, nccl_type(dtype),
                               nccl_op(op), (ncclComm_t)c->nccl, (cudaStream_t)c->dev_stream),
             "ncclAllReduce");
  return GS_SUCCESS;
}

static gs_status_t nccl_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                  int root) {
  NCCL_CHECK(api.ncclBroadcast(buf, buf, (size_t)count, nccl_type(dtype), root,
                               (ncclComm_t)c->nccl, (cudaStream_t)c->dev_stream),
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
  ncclComm_t comm = (ncclComm_t)c->nccl;
  cudaStream_t stream = (cudaStream_t)c->dev_stream;
  size_t es = gs_dtype_size(dtype);
  if (equal_blocks(c, counts, displs)) {
    char *mine = (char *)recv + (size_t)displs[c->rank] * es;
    NCCL_CHECK(api.ncclAllGather(mine, recv, (size_t)counts[0], nccl_type(dtype), comm, stream),
               "ncclAllGather");
    return GS_SUCCESS;
  }
  NCCL_CHECK(api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int root = 0; root < c->size && r == ncclSuccess; root++) {
    char *block = (char *)recv + (size_t)displs[root] * es;
    if (counts[root])
      r = api.ncclBroadcast(block, block, (size_t)counts[root], nccl_type(dtype), root, comm,
                            stream);
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail(r, "ncclBroadcast (allgatherv)");
  NCCL_CHECK(g, "ncclGroupEnd (allgatherv)");
  return GS_SUCCESS;
}

/* Equal blocks: one ncclReduceScatter. Otherwise one ncclReduce per block,
 * rooted at its owner, in one group. */
static gs_status_t nccl_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                       const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  ncclComm_t comm = (ncclComm_t)c->nccl;
  cudaStream_t stream = (cudaStream_t)c->dev_stream;
  size_t es = gs_dtype_size(dtype);
  if (equal_blocks(c, counts, NULL)) {
    NCCL_CHECK(api.ncclReduceScatter(send, recv, (size_t)counts[0], nccl_type(dtype),
                                     nccl_op(op), comm, stream),
               "ncclReduceScatter");
    return GS_SUCCESS;
  }
  NCCL_CHECK(api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  size_t off = 0;
  for (int root = 0; root < c->size && r == ncclSuccess; root++) {
    if (counts[root])
      r = api.ncclReduce((const char *)send + off, recv, (size_t)counts[root], nccl_type(dtype),
                         nccl_op(op), root, comm, stream);
    off += (size_t)counts[root] * es;
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail(r, "ncclReduce (reduce_scatter)");
  NCCL_CHECK(g, "ncclGroupEnd (reduce_scatter)");
  return GS_SUCCESS;
}

gs_status_t gs_nccl_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                             int64_t rcount, gs_dtype_t dtype, int peer) {
  ncclComm_t comm = (ncclComm_t)c->nccl;
  cudaStream_t stream = (cudaStream_t)c->dev_stream;
  NCCL_CHECK(api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  if (scount) r = api.ncclSend(sbuf, (size_t)scount, nccl_type(dtype), peer, comm, stream);
  if (r == ncclSuccess && rcount)
    r = api.ncclRecv(rbuf, (size_t)rcount, nccl_type(dtype), peer, comm, stream);
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail(r, "ncclSend/ncclRecv");
  NCCL_CHECK(g, "ncclGroupEnd (exchange)");
  return GS_SUCCESS;
}

const gs_transport_t gs_nccl_transport = {
    "nccl", nccl_allreduce, nccl_broadcast, nccl_allgatherv, nccl_reduce_scatter,
};

#else /* no NCCL header at build time */

static gs_status_t no_nccl(void) {
  return gs_fail(GS_ERR_UNSUPPORTED, "gradsync was built without NCCL");
}
int gs_nccl_loadable(void) { return 0; }
int gs_nccl_version(void) { return 0; }
gs_status_t gs_nccl_comm_init(gs_comm_t c) { (void)c; return no_nccl(); }
void gs_nccl_comm_free(gs_comm_t c) { c->nccl = NULL; }
gs_status_t gs_nccl_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                             int64_t rcount, gs_dtype_t dtype, int peer) {
  (void)c; (void)sbuf; (void)scount; (void)rbuf; (void)rcount; (void)dtype; (void)peer;
  return no_nccl();
}
static gs_status_t no_allreduce(gs_comm_t c, const void *s, void *r, int64_t n, gs_dtype_t d,
                                gs_op_t o) {
  (void)c; (void)s; (void)r; (void)n; (void)d; (void)o;
  return no_nccl();
}
static gs_status_t no_broadcast(gs_comm_t c, void *b, int64_t n, gs_dtype_t d, int root) {
  (void)c; (void)b; (void)n; (void)d; (void)root;
  return no_nccl();
}
static gs_status_t no_allgatherv(gs_comm_t c, void *r, const int64_t *n, const int64_t *o,
                                 gs_dtype_t d) {
  (void)c; (void)r; (void)n; (void)o; (void)d;
  return no_nccl();
}
static gs_status_t no_reduce_scatter(gs_comm_t c, const void *s, void *r, const int64_t *n,
                                     gs_dtype_t d, gs_op_t o) {
  (void)c; (void)s; (void)r; (void)n; (void)d; (void)o;
  return no_nccl();
}
const gs_transport_t gs_nccl_transport = {
    "nccl", no_allreduce, no_broadcast, no_allgatherv, no_reduce_scatter,
};
#endif
