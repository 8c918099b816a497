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
  gs_check_head_t h;
  unsigned char payload[GS_CHECK_PAYLOAD_BYTES] __attribute__((aligned(16)));
} check_msg_t;

static int consistent(const int64_t *sig) {
  for (int f = 0; f < NFIELDS; f++)
    if (sig[f] != -sig[NFIELDS + f]) return 0;
  return 1;
}

/* into = max(from, into), field by field: max and min of every field at once. */
static void merge_sig(const int64_t *from, int64_t *into) {
  for (int f = 0; f < 2 * NFIELDS; f++)
    if (from[f] > into[f]) into[f] = from[f];
}

void gs_check_combine(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  check_msg_t *a = in, *b = inout;
  for (int k = 0; k < *len; k++, a++, b++) {
    int reduce = b->h.sig[F_PAYLOAD] && consistent(a->h.sig) && consistent(b->h.sig) &&
                 !b->h.sig[F_ERROR] && memcmp(a->h.sig, b->h.sig, sizeof a->h.sig) == 0;
    merge_sig(a->h.sig, b->h.sig);
    if (reduce)
      gs_cpu_reduce((gs_dtype_t)b->h.payload_dtype, (gs_op_t)b->h.payload_op, a->payload,
                    b->payload, b->h.payload_count);
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

/* Over the host's shared region (transport/shm/): every rank's head (and
 * payload) in its slot, one exchange, then each rank merges the heads in
 * rank order; the payload stays in the slots for the caller to fold
 * (payload->peers), or, for a payload of the caller's own memory, is folded
 * into it here. */
static gs_status_t agree_shared(gs_comm_t c, const gs_call_t *call, check_msg_t *msg,
                                gs_payload_t *payload) {
  char *mine = gs_shm_mine(c->shm);
  memcpy(mine, &msg->h, sizeof msg->h);
  size_t bytes = payload ? (size_t)payload->count * gs_dtype_size(payload->dtype) : 0;
  if (payload && payload->data != mine + GS_CHECK_SLOT_PAYLOAD)
    memcpy(mine + GS_CHECK_SLOT_PAYLOAD, payload->data, bytes);
  gs_stall_t st = {c, call, 0.0, 0}; /* the clock starts at the first tick */
  const void *const *slots = NULL;
  gs_status_t e = gs_shm_exchange(c->shm, "validation exchange",
                                  c->stall_seconds > 0 ? gs_stall_tick_shared : NULL, &st, &slots);
  if (e != GS_SUCCESS) {
    char why[GS_ERROR_MAX];
    snprintf(why, sizeof why, "%s", gs_last_error());
    return gs_fail(e, "%s (call #%llu): %s", gs_call_name(call->kind), (unsigned long long)c->seq,
                   why);
  }
  msg->h = *(const gs_check_head_t *)slots[0];
  for (int r = 1; r < c->size; r++) merge_sig(((const gs_check_head_t *)slots[r])->sig, msg->h.sig);
  if (!payload || !consistent(msg->h.sig) || msg->h.sig[F_ERROR]) return GS_SUCCESS;
  payload->peers = slots;
  if (payload->data != mine + GS_CHECK_SLOT_PAYLOAD) { /* rank-order fold, as the caller would */
    memcpy(payload->data, (const char *)slots[0] + GS_CHECK_SLOT_PAYLOAD, bytes);
    for (int r = 1; r < c->size; r++)
      gs_cpu_reduce(payload->dtype, payload->op, (const char *)slots[r] + GS_CHECK_SLOT_PAYLOAD,
                    payload->data, payload->count);
    payload->peers = NULL;
  }
  return GS_SUCCESS;
}

int64_t gs_check_payload_limit(gs_comm_t c) {
  if (!c->shm) return GS_CHECK_PAYLOAD_BYTES;
  int64_t slot = (int64_t)gs_shm_slot_bytes(c->shm) - GS_CHECK_SLOT_PAYLOAD;
  /* from the cross-memory threshold up, reading the peers where they lie
   * beats a copy in and a fold out of the slots (1 MiB at 2 ranks: 165 us
   * against 320) */
  return c->cma_bytes > 0 && c->cma_bytes - 1 < slot ? c->cma_bytes - 1 : slot;
}

void *gs_check_payload_area(gs_comm_t c) {
  return c->shm ? (char *)gs_shm_mine(c->shm) + GS_CHECK_SLOT_PAYLOAD : NULL;
}

/* This rank's signature of the call, every field also negated. */
static void sign(gs_comm_t c, const gs_call_t *call, gs_status_t local, int payload, int64_t *v) {
  gs_check_fields(c, call, local, v);
  v[F_PAYLOAD] = payload;
  /* every field is sent negated too: INT64_MIN (a hostile n) has no negation */
  for (int f = 0; f < NFIELDS; f++) {
    if (v[f] == INT64_MIN) v[f] = INT64_MIN + 1;
    v[NFIELDS + f] = -v[f];
  }
}

gs_status_t gs_check_call(gs_comm_t c, const gs_call_t *call, gs_status_t local,
                          gs_payload_t *payload) {
  c->stats.validations++; /* c->seq counts at the call's start (skeleton.c) */
  check_msg_t msg;
  memset(&msg.h, 0, sizeof msg.h);
  sign(c, call, local, payload != NULL, msg.h.sig);
  size_t payload_bytes = 0;
  if (payload) {
    payload_bytes = (size_t)payload->count * gs_dtype_size(payload->dtype);
    msg.h.payload_count = payload->count;
    msg.h.payload_dtype = (int32_t)payload->dtype;
    msg.h.payload_op = (int32_t)payload->op;
    payload->peers = NULL;
    if (!c->shm) memcpy(msg.payload, payload->data, payload_bytes);
  }
  char saved[GS_REASON_LEN] = "";
  if (local != GS_SUCCESS) snprintf(saved, sizeof saved, "%s", gs_last_error());
  GS_CHECK(c->shm ? agree_shared(c, call, &msg, payload) : agree(c, call, &msg));
  const int64_t *v = msg.h.sig;
  if (consistent(v) && v[F_ERROR] == 0) {
    if (payload) {
      if (!c->shm) memcpy(payload->data, msg.payload, payload_bytes);
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
