/* gradsync private, transport/ (a layer: docs/ARCHITECTURE.md): the table alone. One
 * gs_transport_t per way of moving data, each transport in its own folder with its own
 * header (transport/mpi/: host memory, and device memory through MPI; transport/nccl/),
 * so a new transport (UCC, Gloo) is one folder. Every call takes 64-bit counts. `op` is a
 * reduction (sum, min, max, prod): average and the scales are the engine's. */
#ifndef GRADSYNC_TRANSPORT_H
#define GRADSYNC_TRANSPORT_H

#include "mpi/gs_mpi.h"

/* One piece of a message's memory: `count` elements at `at`; a message is
 * its segments back to back. in == NULL: in place on out. */
typedef struct gs_seg {
  void *at;
  int64_t count;
} gs_seg_t;

typedef gs_status_t (*gs_exchange_fn)(gs_comm_t, const void *send, int64_t scount, void *recv,
                                      int64_t rcount, gs_dtype_t, int peer);

typedef struct gs_transport {
  const char *name;
  /* send == NULL: in place on recv. */
  gs_status_t (*allreduce)(gs_comm_t, const void *send, void *recv, int64_t count, gs_dtype_t,
                           gs_op_t);
  gs_status_t (*broadcast)(gs_comm_t, void *buf, int64_t count, gs_dtype_t, int root);
  /* recv holds size blocks: block r has counts[r] elements at displs[r].
   * This rank's block is already in place in recv. */
  gs_status_t (*allgatherv)(gs_comm_t, void *recv, const int64_t *counts, const int64_t *displs,
                            gs_dtype_t);
  /* send holds size blocks (counts[r] elements each, back to back); recv
   * gets this rank's block reduced. */
  gs_status_t (*reduce_scatter)(gs_comm_t, const void *send, void *recv, const int64_t *counts,
                                gs_dtype_t, gs_op_t);
  /* Sends scount elements to `peer` and receives rcount from it (either may
   * be 0): Adasum's halving and the exchange collectives' pairwise rounds. */
  gs_exchange_fn exchange;
  /* Device transports (NULL for host memory): whether the work queued on the
   * communicator's stream up to `event` has finished (1), not yet (0), or
   * failed (-1, *err set, message recorded, naming `what`: the operation
   * whose work it is); abort (may be NULL): what to do
   * when a wait gives up on it (called under the runtime lock: anything slow
   * goes to gs_runtime_after_unlock); detail (may be NULL): the transport's own
   * words on its last error, for messages. */
  int (*poll)(gs_comm_t, void *event, const char *what, gs_status_t *err);
  void (*abort)(gs_comm_t, gs_status_t why);
  const char *(*detail)(gs_comm_t);
  /* Last, so tables listing the fields above in order need not name it.
   * May be NULL. An allreduce of a message lying in segments (a fused
   * list's tensors where they are: nothing packed), each input times `pre`
   * (rounded to the dtype, as packing does), the result times `post`; sets
   * *taken = 0 without touching anything when it declines the message
   * (the same answer on every rank), which then goes through allreduce. */
  gs_status_t (*allreduce_segments)(gs_comm_t, const struct gs_seg *in, const struct gs_seg *out,
                                    int64_t nseg, gs_dtype_t, gs_op_t, double pre, double post,
                                    int *taken);
  /* May be NULL. Every peer's block of an alltoallv at once (NCCL: all the
   * sends and receives in one group, run as one operation): scounts[r]
   * elements at sdispls[r] go to rank r, rcounts[r] from it land at
   * rdispls[r]; the own block is the caller's to copy. */
  gs_status_t (*alltoallv)(gs_comm_t, const void *send, const int64_t *scounts,
                           const int64_t *sdispls, void *recv, const int64_t *rcounts,
                           const int64_t *rdispls, gs_dtype_t);
} gs_transport_t;

/* Host memory through MPI (mpi.c). */
extern const gs_transport_t gs_mpi_transport;
/* MPI's own allreduce, chunked, never touching the data: device pointers
 * may go in when MPI is CUDA-aware and the op is MPI's. */
gs_status_t gs_mpi_native_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op);
/* Device buffers straight to a CUDA-aware MPI (cuda_aware.c):
 * detected with MPIX_GPU_query_support, or GRADSYNC_CUDA_AWARE_MPI=0/1. */
extern const gs_transport_t gs_cuda_aware_transport;
int gs_mpi_cuda_aware(void);
/* MPI over pinned host staging for device buffers (staged.c). */
extern const gs_transport_t gs_staged_transport;
/* NCCL (nccl.c): opened at run time; these fail cleanly when it
 * is absent. */
extern const gs_transport_t gs_nccl_transport;
int gs_nccl_loadable(void);
gs_status_t gs_nccl_comm_init(gs_comm_t c); /* collective over c->mpi */
/* ncclCommFinalize (polled), then ncclCommDestroy; on failure aborted
 * instead and c unusable. Only after c's last work on its stream finished. */
gs_status_t gs_nccl_comm_free(gs_comm_t c);

#endif
