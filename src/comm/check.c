/* Cross-rank validation.
 *
 * Happy path: one small allreduce (MAX of each field and of its negation, so
 * every rank learns min and max at once). Only when a field differs do the
 * ranks gather full records to say what differs and where; every rank takes
 * the same path, so a mismatch never leaves a rank waiting
 * (check_explain.c says what differs; check_stall.c warns of late ranks). */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "comm/gs_comm_internal.h"

/* What every rank contributes: its signature (each field, then each field
 * negated, so a MAX merge yields max and min at once) and, for small calls,
 * the data itself. Fixed size, so ranks that disagree still make matching
 * MPI calls. */
typedef struct check_msg {
  int64_t sig[2 * NFIELDS];
  int64_t payload_count;
  int32_t payload_dtype, payload_op;
  unsigned char payload[GS_CHECK_PAYLOAD_BYTES] __attribute__((aligned(16)));
} check_msg_t;

static int consistent(const int64_t *sig) {
  for (int f = 0; f < NFIELDS; f++)
    if (sig[f] != -sig[NFIELDS + f]) return 0;
  return 1;
}

void gs_check_combine(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  check_msg_t *a = in, *b = inout;
  for (int k = 0; k < *len; k++, a++, b++) {
    int reduce = b->sig[F_PAYLOAD] && consistent(a->sig) && consistent(b->sig) &&
                 !b->sig[F_ERROR] && memcmp(a->sig, b->sig, sizeof a->sig) == 0;
    for (int f = 0; f < 2 * NFIELDS; f++)
      if (a->sig[f] > b->sig[f]) b->sig[f] = a->sig[f];
    if (reduce)
      gs_cpu_reduce((gs_dtype_t)b->payload_dtype, (gs_op_t)b->payload_op, a->payload, b->payload,
                    b->payload_count);
  }
}

#define CHECK_TAG 0x6763

/* Sends `mine` to `peer` and receives its message into `theirs`; the wait
 * on the receive carries the stall warning. */
static gs_status_t swap(void *ctx, const void *mine, void *theirs, int peer) {
  gs_stall_t *st = ctx;
  gs_comm_t c = st->c;
  MPI_Request r = MPI_REQUEST_NULL, s = MPI_REQUEST_NULL;
  if (theirs)
    GS_MPI_CHECK(MPI_Irecv(theirs, (int)sizeof(check_msg_t), MPI_BYTE, peer, CHECK_TAG, c->mpi, &r),
                 "validation MPI_Irecv");
  if (mine)
    GS_MPI_CHECK(MPI_Isend(mine, (int)sizeof(check_msg_t), MPI_BYTE, peer, CHECK_TAG, c->mpi, &s),
                 "validation MPI_Isend");
  const char *what = "validation exchange";
  gs_status_t e = GS_SUCCESS;
  if (theirs) e = gs_mpi_wait(&r, what, c->stall_seconds > 0 ? gs_stall_tick : NULL, st);
  if (mine && e == GS_SUCCESS) e = gs_mpi_wait(&s, what, NULL, NULL);
  if (e == GS_SUCCESS) return e;
  /* a timeout's message names the collective the ranks were meeting for
   * (formatted here, on failure only: every call passes through) */
  char why[GS_ERROR_MAX];
  snprintf(why, sizeof why, "%s", gs_last_error());
  return gs_fail(e, "%s (call #%llu): %s", gs_call_name(st->call->kind), (unsigned long long)c->seq,
                 why);
}

/* gs_check_combine merges into its second argument: the upper one. */
static gs_status_t merge(void *ctx, const void *lower, const void *upper, void *out) {
  (void)ctx;
  int len = 1;
  gs_check_combine((void *)lower, (void *)upper, &len, NULL);
  if (out != upper) memcpy(out, upper, sizeof(check_msg_t));
  return GS_SUCCESS;
}

/* Merges the ranks' messages by recursive doubling (rdouble.c): as cheap as
 * a blocking allreduce (a 300-byte exchange costs about 1.0 us at 2 ranks
 * against 1.7 us for MPICH's MPI_Iallreduce) yet nonblocking, so waiting
 * ranks yield the core and can warn of stalls. */
static gs_status_t agree(gs_comm_t c, const gs_call_t *call, check_msg_t *msg) {
  gs_stall_t st = {c, call, 0.0, 0}; /* the clock starts at the first tick */
  check_msg_t other;
  gs_rd_t rd = {c->rank, c->size, swap, merge, NULL, &st};
  return gs_rdouble(&rd, msg, &other);
}

gs_status_t gs_check_call(gs_comm_t c, const gs_call_t *call, gs_status_t local,
                          gs_payload_t *payload) {
  c->stats.validations++; /* c->seq counts at the call's start (skeleton.c) */
  check_msg_t msg;
  memset(&msg, 0, sizeof msg);
  int64_t *v = msg.sig;
  v[F_KIND] = call->kind;
  v[F_OP] = call->op;
  v[F_ROOT] = call->root;
  v[F_N] = call->n;
  v[F_HASH] = local == GS_SUCCESS ? (int64_t)gs_check_hash(call) : 0;
  v[F_THRESHOLD] = c->fusion_threshold;
  v[F_DIRECT] = c->direct_bytes;
  v[F_PIPELINE] = c->pipeline_bytes;
  v[F_CMA] = c->cma_bytes; /* whether a large call reads the peers: all or none */
  v[F_ERROR] = local != GS_SUCCESS;
  v[F_PAYLOAD] = payload != NULL;
  /* every field is sent negated too: INT64_MIN (a hostile n) has no negation */
  for (int f = 0; f < NFIELDS; f++) {
    if (v[f] == INT64_MIN) v[f] = INT64_MIN + 1;
    v[NFIELDS + f] = -v[f];
  }
  size_t payload_bytes = 0;
  if (payload) {
    payload_bytes = (size_t)payload->count * gs_dtype_size(payload->dtype);
    msg.payload_count = payload->count;
    msg.payload_dtype = (int32_t)payload->dtype;
    msg.payload_op = (int32_t)payload->op;
    memcpy(msg.payload, payload->data, payload_bytes);
  }
  char saved[GS_REASON_LEN] = "";
  if (local != GS_SUCCESS) snprintf(saved, sizeof saved, "%s", gs_last_error());
  GS_CHECK(agree(c, call, &msg));
  if (consistent(v) && v[F_ERROR] == 0) {
    if (payload) {
      memcpy(payload->data, msg.payload, payload_bytes);
      c->stats.rode_in_check++;
    }
    return GS_SUCCESS;
  }
  if (consistent(v)) return gs_fail(local, "%s", saved); /* every rank failed its own checks */
  if (local != GS_SUCCESS) gs_fail(local, "%s", saved);
  return gs_check_explain(c, call, local);
}

gs_status_t gs_begin_call(gs_comm_t c, const gs_call_t *call, gs_status_t local) {
  c->stats.calls++;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG, "%s: %lld tensors, %lld bytes, op %s", gs_call_name(call->kind),
           (long long)call->n, (long long)gs_call_bytes(call), gs_op_name(call->op));
  if (!c->check) return local;
  double t0 = GS_TL_START();
  gs_status_t s = gs_check_call(c, call, local, NULL);
  GS_TL_END("validate", gs_call_name(call->kind), 0, t0, gs_call_bytes(call));
  return s;
}
