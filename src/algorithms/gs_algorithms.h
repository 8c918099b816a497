/* gradsync private, algorithms/ (a layer: docs/ARCHITECTURE.md): Adasum over the transport and
 * kernel entries (adasum.c), and where the exchange collectives' data goes
 * (xfer.c), the wire allreduce on CUDA memory (wire_device.c). */
#ifndef GRADSYNC_ALGORITHMS_H
#define GRADSYNC_ALGORITHMS_H

#include "engine/gs_queue.h"
/* gs_xfer_t, one tensor's movement, which xfer.c hands to MPI's own
 * collectives when every count fits int */
#include "transport/mpi/gs_mpi_xfer.h"

/* ---- Adasum (adasum.c) --------------------------------------------------- */

/* Adasum over one message held contiguously in `x` (the message's elements,
 * tensor boundaries from the plan's slots). The result replaces x on every
 * rank. */
gs_status_t gs_adasum_message(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                              void *x, int sum_levels);
/* Hierarchical Adasum's group size for this communicator, or an argument
 * error naming the unmet condition (checked before the ranks meet). */
gs_status_t gs_adasum_group_size(gs_comm_t comm, const char *fn, int *size);
/* Frees the per-level communicators Adasum caches on a communicator. */
void gs_adasum_free(gs_comm_t comm);

/* ---- the exchange collectives' data movement (xfer.c) -------------------- */

gs_status_t gs_xfer_alltoallv(const gs_engine_t *e, const gs_xfer_t *x);
gs_status_t gs_xfer_gatherv(const gs_engine_t *e, const gs_xfer_t *x);
gs_status_t gs_xfer_scatterv(const gs_engine_t *e, const gs_xfer_t *x);
/* recv (root only) = op over ranks of send; send == recv at the root: in place. */
gs_status_t gs_xfer_reduce(const gs_engine_t *e, const void *send, void *recv, int64_t count,
                           gs_dtype_t dtype, gs_op_t op, int root);

/* ---- the wire allreduce on CUDA memory (wire_device.c) ------------------- */

/* Message m of in (float32; float16/bfloat16 with a float8 wire) allreduced
 * in `wire` into out (may be in): transport/mpi/wire.c's algorithm, encoding
 * and decoding fused into the pack and unpack kernels, the exchanges
 * grouped sends and receives. residual (may be NULL): float32 CUDA memory
 * per tensor, error feedback as gs_allreduce_wire's. */
gs_status_t gs_wire_device_message(const gs_engine_t *e, const gs_plan_t *plan,
                                   const gs_message_t *m, const gs_tensor_t *in,
                                   const gs_tensor_t *out, const gs_tensor_t *residual,
                                   gs_wire_t wire, double pre, double post);

#endif
