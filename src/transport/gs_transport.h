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

/* Work the caller does per segment (the fusion engine's packing and
 * unpacking), so it overlaps the other segments' transfers: prepare fills
 * x[first, first + n) before that segment starts; finish runs once
 * x[first, first + n) (and lost's) are final. Either may be NULL.
 * out (may be NULL): where the message lies, nseg segments back to back
 * (in: the input's, NULL in place), when the result needs no more than
 * the sum times post (float32, no prescale, no error feedback): where a
 * host's ranks read each other's memory, the hierarchical path's host
 * stages read and write the message there, and such segments are neither
 * prepared nor finished. */
typedef struct gs_wire_hooks {
  gs_status_t (*prepare)(void *ctx, int64_t first, int64_t n);
  gs_status_t (*finish)(void *ctx, int64_t first, int64_t n);
  void *ctx;
  const gs_seg_t *in, *out;
  int64_t nseg;
} gs_wire_hooks_t;

/* What a table's route answers (below). A function pointer, not a code: the collective
 * calls the path it was given. */
typedef struct gs_route {
  /* allreduce_segments takes the run (all run_count elements where they lie) */
  int segments;
  /* otherwise each piece of `piece` elements (0: the whole message) goes through run */
  int64_t piece;
  gs_status_t (*run)(gs_comm_t, const void *send, void *recv, int64_t count, gs_dtype_t, gs_op_t);
  /* the same message as float32 in a low-precision wire format (transport/mpi/wire.c):
   * x becomes the sum times post, lost (may be NULL) gets the rounding (error
   * feedback); wire_segments: the path reads and writes the message where it lies
   * when the hooks name its segments (in, out, nseg) */
  gs_status_t (*wire)(gs_comm_t, float *x, int64_t count, gs_wire_t, double post, float *lost,
                      const gs_wire_hooks_t *hooks);
  int wire_segments;
} gs_route_t;

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
  /* May be NULL (then every message goes whole through allreduce). The path of an
   * allreduce of `count` elements, asked once per message (NCCL's topoGetAlgoInfo, UCC's
   * coll_score: the collective runs what it is given and asks nothing more); the same
   * answer on every rank. run_count and run_nseg (0: none) describe the run of messages
   * of its dtype that starts with it, in the segments it lies in: the path may take
   * them all at once through allreduce_segments (route->segments). */
  gs_status_t (*route)(gs_comm_t, gs_dtype_t, int64_t count, int64_t run_count, int64_t run_nseg,
                       gs_route_t *route);
  /* May be NULL. The transport's working state, behind an opaque pointer in the
   * communicator that only the transport reads (MPI's: c->host_state, made with every
   * communicator, comm/lifecycle.c; NCCL's: c->nccl, made when the device path is
   * chosen, engine/path.c). init is collective over c->mpi; free comes after the
   * communicator's last work, and may fail (NCCL's finalize: c is unusable then). */
  gs_status_t (*init)(gs_comm_t);
  gs_status_t (*free)(gs_comm_t);
} gs_transport_t;

/* The tables. Host memory through MPI (transport/mpi/mpi.c); device buffers
 * straight to a CUDA-aware MPI (cuda_aware.c: detected with
 * MPIX_GPU_query_support, or GRADSYNC_CUDA_AWARE_MPI=0/1, gs_mpi_cuda_aware)
 * or over pinned host staging (staged.c); NCCL (transport/nccl/), opened at
 * run time: gs_nccl_loadable says whether it can be. Only the MPI table has
 * a route: the device tables move a message whole. */
extern const gs_transport_t gs_mpi_transport;
extern const gs_transport_t gs_cuda_aware_transport;
extern const gs_transport_t gs_staged_transport;
extern const gs_transport_t gs_nccl_transport;
int gs_mpi_cuda_aware(void);
int gs_nccl_loadable(void);

#endif
