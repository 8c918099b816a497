/* gradsync private, transport/nccl/: what the NCCL transport's two files share
 * (nccl.c: the library, polling and communicators; nccl_ops.c: the data
 * movement). Included only where GS_HAVE_NCCL is defined. */
#ifndef GRADSYNC_NCCL_INTERNAL_H
#define GRADSYNC_NCCL_INTERNAL_H

#include <nccl.h>

#include "transport/gs_transport.h"

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

/* The entry points, opened at run time (nccl.c). */
typedef struct gs_nccl_api {
#define NCCL_POINTER(name) __typeof__(name) *name;
  NCCL_FUNCTIONS(NCCL_POINTER)
#undef NCCL_POINTER
  void *handle;
  int version;
  char error[512];
} gs_nccl_api_t;
extern gs_nccl_api_t gs_nccl_api;

/* A call on a non-blocking communicator: ncclInProgress is polled until
 * the call is done (its enqueue, not its kernel); any error aborts. */
gs_status_t gs_nccl_settle(gs_comm_t c, ncclResult_t r, const char *what);
#define NCCL_CALL(c, call, what) GS_CHECK(gs_nccl_settle((c), (call), (what)))
/* The table's init (collective over c->mpi) and free: ncclCommFinalize
 * (polled), then ncclCommDestroy; on failure aborted instead and c
 * unusable. Only after c's last work on its stream finished. */
gs_status_t gs_nccl_comm_init(gs_comm_t c);
gs_status_t gs_nccl_comm_free(gs_comm_t c);
/* The transport table's poll, abort and detail (gs_transport_t). */
int gs_nccl_poll(gs_comm_t c, void *event, const char *what, gs_status_t *err);
void gs_nccl_abort(gs_comm_t c, gs_status_t why);
const char *gs_nccl_detail(gs_comm_t c);

#endif
