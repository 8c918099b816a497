/* gradsync private, mpi/ (a layer: docs/ARCHITECTURE.md): MPI's types and ops for gradsync's
 * dtypes (types.c), the MPI wait (wait.c) and the one recursive
 * doubling that validation, small allreduces and Adasum's fold share
 * (rdouble.c). */
#ifndef GRADSYNC_MPI_H
#define GRADSYNC_MPI_H

#include "mpi/gs_comm_state.h"

/* ---- types and ops (types.c) -------------------------------------------- */

gs_status_t gs_mpi_datatype(gs_dtype_t dtype, MPI_Datatype *out);
/* `op` is a reduction (sum, min, max, prod; average sums): float16/bfloat16
 * and NaN-propagating float min/max are gradsync's own user ops. */
gs_status_t gs_mpi_op(gs_dtype_t dtype, gs_op_t op, MPI_Op *out);
/* The op is MPI's own (no gradsync host operator behind it). */
int gs_mpi_op_is_builtin(gs_dtype_t dtype, gs_op_t op);
/* An MPI datatype carrying `count` elements in one message (a derived type
 * past GRADSYNC_MPI_MAX_COUNT): *n is the count to pass with *type, and
 * *derived says the caller must MPI_Type_free it. */
gs_status_t gs_mpi_big_type(gs_dtype_t dtype, int64_t count, MPI_Datatype *type, int *n,
                            int *derived);

/* ---- waiting (wait.c) ----------------------------------------------------- */

/* Turns an MPI error code into GS_ERR_MPI with MPI's own message. */
gs_status_t gs_mpi_fail(int mpi_err, const char *what);
#define GS_MPI_CHECK(call, what)                                         \
  do {                                                                   \
    int gs_mpi_e_ = (call);                                              \
    if (gs_mpi_e_ != MPI_SUCCESS) return gs_mpi_fail(gs_mpi_e_, (what)); \
  } while (0)
/* Called while waiting on an MPI request, about every 128 polls, with the
 * seconds waited so far; may complete the request itself (then sets *done). */
typedef void (*gs_wait_tick)(void *ctx, MPI_Request *req, int *done, double waited);
/* Completes a nonblocking MPI call through gs_progress_wait; on giving up
 * the request is cancelled. `tick` may be NULL. */
gs_status_t gs_mpi_wait(MPI_Request *req, const char *what, gs_wait_tick tick, void *ctx);
/* Completes an MPI call started either way: `e` is its return code, and
 * req == NULL means it was blocking. */
gs_status_t gs_mpi_finish(int e, MPI_Request *req, const char *what);
/* Messages below this size use MPI's blocking calls when every rank has a
 * core of its own and MPI rules threads out: they are cheapest there (MPICH
 * 5, 2 ranks: 16 floats 0.27 us blocking, 0.7 us nonblocking). Larger ones,
 * and all of them on an oversubscribed node, are nonblocking with the
 * yielding wait (16 MiB: 57.8 ms blocking, 4.8 ms nonblocking). */
#define GS_BLOCKING_MAX_BYTES ((int64_t)65536)
int gs_use_blocking(gs_comm_t comm, int64_t bytes);

/* ---- recursive doubling (rdouble.c) ----------------------------------------
 * Ranks Q..P-1 (Q the largest power of two <= P) fold into 0..Q-1 first and
 * get the result back last; in between the ranks 0..Q-1 run `core`, or, when
 * core is NULL, log2(Q) levels of pairwise swaps. At every level both
 * partners compute combine(lower, upper), so every rank ends with the same
 * bits. */
typedef struct gs_rd {
  int rank, size;
  /* Sends `send` to `peer` (unless NULL) and receives into `recv` (unless NULL). */
  gs_status_t (*swap)(void *ctx, const void *send, void *recv, int peer);
  /* out = lower (+) upper, where out is lower's or upper's memory. */
  gs_status_t (*combine)(void *ctx, const void *lower, const void *upper, void *out);
  /* May be NULL: the ranks 0..Q-1's own algorithm in place of the levels. */
  gs_status_t (*core)(void *ctx, int q);
  void *ctx;
} gs_rd_t;
/* The largest power of two <= size. */
int gs_rd_core_size(int size);
/* Runs the pattern on `buf` (the result ends there on every rank); `other`
 * receives the partner's data (the same size). */
gs_status_t gs_rdouble(const gs_rd_t *rd, void *buf, void *other);

#endif
