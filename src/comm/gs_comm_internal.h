/* gradsync private, comm/ (a layer: docs/ARCHITECTURE.md): communicators (lifecycle.c),
 * argument checks (args.c) and cross-rank validation (check.c, with
 * check_explain.c and check_stall.c). */
#ifndef GRADSYNC_COMM_INTERNAL_H
#define GRADSYNC_COMM_INTERNAL_H

#include "algorithms/gs_algorithms.h"
#include "base/gs_flight_ring.h"
#include "transport/shm/gs_shm.h"

/* ---- communicators (lifecycle.c) ------------------------------------------ */

/* Validates a handle at an API entry point. */
gs_status_t gs_comm_valid(gs_comm_t comm, const char *where);
/* gs_comm_valid, plus: a communicator that timed out or was interrupted
 * stays unusable (its ranks may be mid-collective); binds its fate to the
 * calling thread for the rest of the call. */
gs_status_t gs_comm_enter(gs_comm_t comm, const char *where);

/* ---- cross-rank validation (check.c, check_explain.c, check_stall.c) ---- */

typedef enum gs_call_kind {
  GS_CALL_BARRIER = 1,
  GS_CALL_ALLREDUCE = 2,
  GS_CALL_BROADCAST = 3,
  GS_CALL_ALLGATHER_COUNTS = 4,
  GS_CALL_ALLGATHERV = 5,
  GS_CALL_REDUCE_SCATTER = 6,
  GS_CALL_ALLGATHER_SHARDS = 7,
  GS_CALL_REDUCE_SCATTER_SHARDS = 8,
  GS_CALL_ALLTOALL_COUNTS = 9,
  GS_CALL_ALLTOALLV = 10,
  GS_CALL_GATHERV = 11,
  GS_CALL_SCATTERV = 12,
  GS_CALL_REDUCE = 13,
  GS_CALL_ALLGATHER_ROWS = 14
} gs_call_kind_t;

const char *gs_call_name(gs_call_kind_t kind);

/* Calls whose whole data fits here travel inside the validation message: one
 * collective validates and reduces them (small allreduces, latency bound). */
/* 128 bytes through MPI: a loss/metrics vector fits, and the message (288
 * bytes) stays cheap for calls that carry none. Over the host's shared
 * region (transport/shm/) a payload fills the rest of a slot. */
#define GS_CHECK_PAYLOAD_BYTES 128
/* The largest payload on communicator c (its region's, or the MPI message's). */
int64_t gs_check_payload_limit(gs_comm_t c);
/* Where a payload is packed on c: this rank's slot of the shared region, so
 * that the data is copied once (NULL: c has no region; pack anywhere). */
void *gs_check_payload_area(gs_comm_t c);

/* The validation messages' merge: signatures, and where both sides agree and
 * carry a payload, the payloads (check.c). MPI_User_function's shape. */
void gs_check_combine(void *in, void *inout, int *len, MPI_Datatype *dt);

/* A small allreduce riding in the validation message: `data` holds the packed
 * input (count elements of dtype); on success it holds the reduction. */
typedef struct gs_payload {
  void *data;
  int64_t count;
  gs_dtype_t dtype;
  gs_op_t op;
  /* Set on success when `data` was gs_check_payload_area's: the reduction is
   * not made; peers[r] + GS_CHECK_SLOT_PAYLOAD is rank r's packed data, to
   * fold in rank order, readable until the communicator's next call. */
  const void *const *peers;
} gs_payload_t;

/* What a rank is about to do. `extra` (n values, may be NULL) is one more
 * per-tensor number the ranks must agree on (row size for allgather, rows for
 * reduce_scatter). */
typedef struct gs_call {
  gs_call_kind_t kind;
  gs_op_t op;
  int root;
  int64_t n;
  const gs_tensor_t *tensors;
  const int64_t *extra;
  const char *extra_name;
  int counts_vary;         /* element counts may differ by rank (allgather) */
  uint64_t tag;            /* the caller's call tag (gs_set_call_options); 0: none */
} gs_call_t;

/* Meets the other ranks and compares calls. `local` is GS_SUCCESS or the
 * argument error this rank found (with gs_last_error() set): the rank still
 * takes part so nobody waits, and gets its own error back. Returns
 * GS_ERR_MISMATCH with a message naming what differs and which ranks. */
gs_status_t gs_check_call(gs_comm_t comm, const gs_call_t *call, gs_status_t local,
                          gs_payload_t *payload);

/* gs_check_call when validation is on; otherwise just returns `local`. */
gs_status_t gs_begin_call(gs_comm_t comm, const gs_call_t *call, gs_status_t local);

/* The longest argument error a rank shares with the others. */
#define GS_REASON_LEN 200
/* The validation signature's fields (check.c; check_explain.c names them). */
enum {
  F_KIND,
  F_OP,
  F_ROOT,
  F_N,
  F_HASH,
  F_THRESHOLD,
  F_DIRECT,
  F_PIPELINE,
  F_CMA,
  F_TAG_HI, /* the call tag's two halves: each compared exactly */
  F_TAG_LO,
  F_ERROR,
  F_PAYLOAD,
  NFIELDS
};

/* A validation message's head: the signature (each field, then each field
 * negated, so a MAX merge yields max and min at once) and what its payload
 * holds. In a shared slot the payload follows at GS_CHECK_SLOT_PAYLOAD. */
typedef struct gs_check_head {
  int64_t sig[2 * NFIELDS];
  int64_t payload_count;
  int32_t payload_dtype, payload_op;
} gs_check_head_t;
#define GS_CHECK_SLOT_PAYLOAD ((sizeof(gs_check_head_t) + 63) / 64 * 64)

/* This rank's signature fields of a call (F_PAYLOAD left 0). */
void gs_check_fields(gs_comm_t c, const gs_call_t *call, gs_status_t local, int64_t *v);
/* The hash of a call's tensor list (dtypes, counts, extras, memory kind). */
uint64_t gs_check_hash(const gs_call_t *call);
/* Bytes a call moves (for logs, the timeline and the stall warning). */
int64_t gs_call_bytes(const gs_call_t *call);
/* After a mismatch: every rank builds the same message naming what differs
 * (collective over comm). Returns `local` if this rank failed its own
 * checks, else GS_ERR_MISMATCH with the message. */
gs_status_t gs_check_explain(gs_comm_t comm, const gs_call_t *call, gs_status_t local);
/* Appends "a,b,c-f" for the ranks with mark[r] == want. */
void gs_format_ranks(char *buf, size_t cap, const unsigned char *mark, int p, int want);

/* The stall warning (check_stall.c): the tick of validation's waits. */
typedef struct gs_stall {
  gs_comm_t c;
  const gs_call_t *call;
  double start; /* 0 until the first tick: most checks never tick */
  int warned;
} gs_stall_t;
void gs_stall_tick(void *ctx, MPI_Request *req, int *done, double waited);
/* The same over the shared region, which shows who has arrived (gs_shm_tick_fn). */
void gs_stall_tick_shared(void *ctx, const unsigned char *arrived, int p, double waited);

/* ---- argument checks shared by the collectives (args.c) ----------------- */

/* Checks a tensor list for one call; `name` names it in messages ("in",
 * "tensors"). Floating scales/ops need floating dtypes. */
gs_status_t gs_check_tensors(const char *op_name, const char *name, const gs_tensor_t *t,
                             int64_t n);
gs_status_t gs_check_op(const char *op_name, gs_op_t op, const gs_tensor_t *t, int64_t n,
                        double prescale, double postscale, int allow_adasum);
/* out[i] must match in[i] in count and dtype. */
gs_status_t gs_check_outputs(const char *op_name, const gs_tensor_t *in, const gs_tensor_t *out,
                             int64_t n);
/* out[i] (written) is in[i] exactly or overlaps no in[j] and no other out[j];
 * the names are the arguments' in messages (gs_accumulate's acc and grad). */
gs_status_t gs_check_pairs_disjoint(const char *op_name, const char *in_name, const gs_tensor_t *in,
                                    const char *out_name, const gs_tensor_t *out, int64_t n);
/* No out[i] overlaps another output or any input (not even its own). */
/* Column i of a rank-major count array (counts[r * n + i], p ranks): each
 * count non-negative and the sum far from overflow; *sum receives it, and
 * *hash (may be NULL) is mixed with every count. */
gs_status_t gs_check_column(const char *fn, const char *name, const int64_t *counts, int64_t n,
                            int p, int64_t i, int64_t *sum, uint64_t *hash);
gs_status_t gs_check_disjoint(const char *op_name, const gs_tensor_t *in, const gs_tensor_t *out,
                              int64_t n);

#endif
