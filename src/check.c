/* Cross-rank validation and the stall warning.
 *
 * Happy path: one small allreduce (MAX of each field and of its negation, so
 * every rank learns min and max at once). Only when a field differs do the
 * ranks gather full records to say what differs and where; every rank takes
 * the same path, so a mismatch never leaves a rank waiting. */
#include <sched.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gs_internal.h"

enum { F_KIND, F_OP, F_ROOT, F_N, F_HASH, F_THRESHOLD, F_DIRECT, F_ERROR, F_PAYLOAD, NFIELDS };
#define REASON_LEN 200
#define NOTICE_TAG 7

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
      gs_cpu_reduce((gs_dtype_t)b->payload_dtype, (gs_op_t)b->payload_op, a->payload,
                    b->payload, b->payload_count);
  }
}

typedef struct record {
  int64_t f[NFIELDS];
  char reason[REASON_LEN];
} record_t;

const char *gs_call_name(gs_call_kind_t kind) {
  switch (kind) {
    case GS_CALL_BARRIER: return "barrier";
    case GS_CALL_ALLREDUCE: return "allreduce";
    case GS_CALL_BROADCAST: return "broadcast";
    case GS_CALL_ALLGATHER_COUNTS: return "allgather";
    case GS_CALL_ALLGATHERV: return "allgatherv";
    case GS_CALL_REDUCE_SCATTER: return "reduce_scatter";
    case GS_CALL_ALLGATHER_SHARDS: return "allgather_shards";
    case GS_CALL_REDUCE_SCATTER_SHARDS: return "reduce_scatter_shards";
    case GS_CALL_ALLTOALL_COUNTS: return "alltoall_counts";
    case GS_CALL_ALLTOALLV: return "alltoallv";
    case GS_CALL_GATHERV: return "gather";
    case GS_CALL_SCATTERV: return "scatter";
    case GS_CALL_REDUCE: return "reduce";
  }
  return "unknown";
}

double gs_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

static uint64_t tensor_hash(const gs_call_t *call) {
  uint64_t h = 0x6772616473796e63ull;
  /* host or CUDA memory: ranks must agree (the paths differ) */
  if (call->n) h = mix(h, call->tensors[0].device.kind == GS_DEVICE_CUDA ? 2u : 1u);
  for (int64_t i = 0; i < call->n; i++) {
    h = mix(h, (uint64_t)call->tensors[i].dtype);
    if (!call->counts_vary) h = mix(h, (uint64_t)call->tensors[i].count);
    if (call->extra) h = mix(h, (uint64_t)call->extra[i]);
  }
  return h & 0x3fffffffffffffffull; /* keep it positive: its negation is sent too */
}

/* ---- the stall warning --------------------------------------------------- */

static int64_t call_bytes(const gs_call_t *call) {
  int64_t b = 0;
  for (int64_t i = 0; i < call->n; i++)
    b += call->tensors[i].count * (int64_t)gs_dtype_size(call->tensors[i].dtype);
  return b;
}

/* Appends "a,b,c-f" for the ranks with mark[r] == want. */
static void append_ranks(char *buf, size_t cap, const unsigned char *mark, int p, int want) {
  size_t len = strlen(buf);
  int first = 1;
  for (int r = 0; r < p && len + 24 < cap; r++) {
    if (mark[r] != want) continue;
    int e = r;
    while (e + 1 < p && mark[e + 1] == want) e++;
    len += (size_t)snprintf(buf + len, cap - len, e > r ? "%s%d-%d" : "%s%d", first ? "" : ",", r, e);
    first = 0;
    r = e;
  }
  if (first) snprintf(buf + len, cap - len, "none");
}

/* Tells the other ranks this one is waiting in call `seq`, listens for the
 * same from them for a grace period, then the lowest waiting rank prints one
 * line naming the ranks that have not arrived. Returns early if the call
 * completes meanwhile. */
static void stall_warning(gs_comm_t c, const gs_call_t *call, MPI_Request *req,
                          int *done, double waited) {
  uint64_t note[2] = {c->seq, (uint64_t)c->rank};
  for (int r = 0; r < c->size; r++) {
    if (r == c->rank) continue;
    MPI_Request sreq;
    if (MPI_Isend(note, 2, MPI_UINT64_T, r, NOTICE_TAG, c->notice, &sreq) == MPI_SUCCESS)
      MPI_Request_free(&sreq); /* tiny eager message: completes locally */
  }
  unsigned char arrived[4096];
  int p = c->size < 4096 ? c->size : 4096;
  memset(arrived, 0, (size_t)p);
  if (c->rank < p) arrived[c->rank] = 1;
  double grace = c->stall_seconds < 1.0 ? c->stall_seconds : 1.0, t0 = gs_now();
  while (!*done && gs_now() - t0 < grace) {
    int flag = 0;
    MPI_Status st;
    MPI_Iprobe(MPI_ANY_SOURCE, NOTICE_TAG, c->notice, &flag, &st);
    if (flag) {
      uint64_t got[2];
      MPI_Recv(got, 2, MPI_UINT64_T, st.MPI_SOURCE, NOTICE_TAG, c->notice, MPI_STATUS_IGNORE);
      if (got[0] == c->seq && st.MPI_SOURCE < p) arrived[st.MPI_SOURCE] = 1;
    }
    MPI_Test(req, done, MPI_STATUS_IGNORE);
    sched_yield();
  }
  if (*done) return;
  for (int r = 0; r < c->rank && r < p; r++)
    if (arrived[r]) return; /* a lower waiting rank speaks for us all */
  char missing[1024] = "", present[1024] = "";
  append_ranks(missing, sizeof missing, arrived, p, 0);
  append_ranks(present, sizeof present, arrived, p, 1);
  gs_log(GS_LOG_WARNING,
         "%s (call #%llu, %lld tensors, %lld bytes) has waited %.1f s; ranks not arrived: %s "
         "(waiting: %s)",
         gs_call_name(call->kind), (unsigned long long)c->seq, (long long)call->n,
         (long long)call_bytes(call), waited + (gs_now() - t0), missing, present);
}

typedef struct stall_ctx {
  gs_comm_t c;
  const gs_call_t *call;
  double start;
  int warned;
} stall_ctx_t;

static void stall_tick(void *ctx, MPI_Request *req, int *done, double waited) {
  stall_ctx_t *st = ctx;
  (void)waited; /* per wait; the stall counts from the start of the check */
  double w = gs_now() - st->start;
  if (st->warned || w < st->c->stall_seconds) return;
  st->warned = 1;
  stall_warning(st->c, st->call, req, done, w);
}

#define CHECK_TAG 0x6763

/* Sends `mine` to `peer` and receives its message into `theirs`; the wait
 * on the receive carries the stall warning. */
static gs_status_t swap(gs_comm_t c, const check_msg_t *mine, check_msg_t *theirs, int peer,
                        int send, int recv, stall_ctx_t *st) {
  MPI_Request r = MPI_REQUEST_NULL, s = MPI_REQUEST_NULL;
  if (recv)
    GS_MPI_CHECK(MPI_Irecv(theirs, (int)sizeof *theirs, MPI_BYTE, peer, CHECK_TAG, c->mpi, &r),
                 "validation MPI_Irecv");
  if (send)
    GS_MPI_CHECK(MPI_Isend(mine, (int)sizeof *mine, MPI_BYTE, peer, CHECK_TAG, c->mpi, &s),
                 "validation MPI_Isend");
  if (recv)
    GS_CHECK(gs_mpi_wait(&r, "validation receive", c->stall_seconds > 0 ? stall_tick : NULL, st));
  if (send) GS_CHECK(gs_mpi_wait(&s, "validation send", NULL, NULL));
  return GS_SUCCESS;
}

/* Merges the ranks' messages by recursive doubling over point-to-point
 * messages: as cheap as a blocking allreduce (a 288-byte exchange costs about
 * 1.0 us at 2 ranks against 1.7 us for MPICH's MPI_Iallreduce) yet
 * nonblocking, so waiting ranks yield the core and can warn of stalls. Ranks
 * Q..P-1 fold into 0..P-Q-1 first and get the result back last. At every
 * level both partners compute combine(lower, upper), so all ranks end with
 * the same bits. */
static gs_status_t agree(gs_comm_t c, const gs_call_t *call, check_msg_t *msg) {
  int p = c->size, me = c->rank, q = 1;
  while (q * 2 <= p) q *= 2;
  stall_ctx_t st = {c, call, gs_now(), 0};
  check_msg_t other;
  int len = 1;
  if (me >= q) {
    GS_CHECK(swap(c, msg, NULL, me - q, 1, 0, &st));
    return swap(c, NULL, msg, me - q, 0, 1, &st);
  }
  if (me < p - q) {
    GS_CHECK(swap(c, NULL, &other, me + q, 0, 1, &st));
    gs_check_combine(msg, &other, &len, NULL); /* lower (me) into upper */
    *msg = other;
  }
  for (int level = 1; level < q; level <<= 1) {
    int partner = me ^ level;
    GS_CHECK(swap(c, msg, &other, partner, 1, 1, &st));
    if (me < partner) {
      gs_check_combine(msg, &other, &len, NULL);
      *msg = other;
    } else {
      gs_check_combine(&other, msg, &len, NULL);
    }
  }
  if (me < p - q) GS_CHECK(swap(c, msg, NULL, me + q, 1, 0, &st));
  return GS_SUCCESS;
}

/* ---- explaining a mismatch ----------------------------------------------- */

typedef const char *(*name_fn)(int64_t v, char *tmp, size_t cap);

static const char *name_int(int64_t v, char *tmp, size_t cap) {
  snprintf(tmp, cap, "%lld", (long long)v);
  return tmp;
}
static const char *name_kind(int64_t v, char *tmp, size_t cap) { (void)tmp; (void)cap; return gs_call_name((gs_call_kind_t)v); }
static const char *name_op(int64_t v, char *tmp, size_t cap) { (void)tmp; (void)cap; return gs_op_name((gs_op_t)v); }
static const char *name_dtype(int64_t v, char *tmp, size_t cap) { (void)tmp; (void)cap; return gs_dtype_name((gs_dtype_t)v); }

/* "what differs: A on ranks 0-2; B on rank 3" for the values vals[r*stride]. */
static void describe(char *buf, size_t cap, const char *what, const int64_t *vals,
                     size_t stride, int p, name_fn name) {
  unsigned char mark[4096];
  int q = p < 4096 ? p : 4096;
  unsigned char done[4096];
  if (q <= 0) return;
  memset(done, 0, (size_t)q);
  size_t len = (size_t)snprintf(buf, cap, "%s differs across ranks:", what);
  for (int r = 0; r < q && len + 64 < cap; r++) {
    if (done[r]) continue;
    int64_t v = vals[(size_t)r * stride];
    for (int s = 0; s < q; s++) {
      mark[s] = vals[(size_t)s * stride] == v;
      if (mark[s]) done[s] = 1;
    }
    char tmp[32];
    len += (size_t)snprintf(buf + len, cap - len, "%s %s on rank(s) ", r ? ";" : "",
                            name(v, tmp, sizeof tmp));
    append_ranks(buf, cap, mark, q, 1);
    len = strlen(buf);
  }
}

/* The whole-call fields, in the order a difference is reported. */
static const struct scalar_field {
  int field;
  const char *label;
  name_fn name;
} scalar_fields[] = {
    {F_KIND, "the collective called", name_kind},
    {F_N, "the number of tensors", name_int},
    {F_OP, "the op", name_op},
    {F_ROOT, "the root", name_int},
    {F_THRESHOLD, "the fusion threshold (bytes)", name_int},
    {F_DIRECT, "the direct-send size (bytes, GRADSYNC_DIRECT_BYTES)", name_int},
};

static const struct scalar_field *first_scalar_difference(const int *differs) {
  for (size_t k = 0; k < sizeof scalar_fields / sizeof scalar_fields[0]; k++)
    if (differs[scalar_fields[k].field]) return &scalar_fields[k];
  return NULL;
}

static gs_status_t explain(gs_comm_t c, const gs_call_t *call, gs_status_t local) {
  int p = c->size;
  record_t mine, *all = malloc((size_t)p * sizeof *all);
  if (!all) return gs_fail(GS_ERR_NO_MEMORY, "validation: out of memory");
  memset(&mine, 0, sizeof mine);
  mine.f[F_KIND] = call->kind;
  mine.f[F_OP] = call->op;
  mine.f[F_ROOT] = call->root;
  mine.f[F_N] = call->n;
  mine.f[F_HASH] = local == GS_SUCCESS ? (int64_t)tensor_hash(call) : 0;
  mine.f[F_THRESHOLD] = c->fusion_threshold;
  mine.f[F_DIRECT] = c->direct_bytes;
  mine.f[F_ERROR] = local != GS_SUCCESS;
  mine.f[F_PAYLOAD] = 0; /* derived from the fields above; never the first difference */
  if (local != GS_SUCCESS) snprintf(mine.reason, REASON_LEN, "%s", gs_last_error());
  int e = MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, c->mpi);
  if (e != MPI_SUCCESS) { free(all); return gs_mpi_fail(e, "validation MPI_Allgather"); }

  char msg[2048] = "";
  const char *name = gs_call_name(call->kind);
  int differs[NFIELDS] = {0};
  for (int f = 0; f < NFIELDS; f++)
    for (int r = 1; r < p; r++)
      if (all[r].f[f] != all[0].f[f]) differs[f] = 1;

  gs_status_t status = GS_ERR_MISMATCH;
  const struct scalar_field *scalar;
  if (differs[F_ERROR] || all[0].f[F_ERROR]) {
    int first = -1;
    unsigned char mark[4096];
    int q = p < 4096 ? p : 4096;
    for (int r = 0; r < q; r++) {
      mark[r] = all[r].f[F_ERROR] != 0;
      if (mark[r] && first < 0) first = r;
    }
    char who[512] = "";
    append_ranks(who, sizeof who, mark, q, 1);
    snprintf(msg, sizeof msg, "%s: rank(s) %s rejected their arguments (rank %d: %s)", name,
             who, first, all[first].reason);
  } else if ((scalar = first_scalar_difference(differs)) != NULL) {
    char what[160];
    /* The collective itself differs: naming this rank's would mislead. */
    snprintf(what, sizeof what, "%s%s%s", scalar->field == F_KIND ? "" : name,
             scalar->field == F_KIND ? "" : ": ", scalar->label);
    _Static_assert(sizeof(record_t) % sizeof(int64_t) == 0, "records are int64-strided");
    describe(msg, sizeof msg, what, &all[0].f[scalar->field], sizeof(record_t) / sizeof(int64_t),
             p, scalar->name);
  } else {
    /* Same count everywhere: gather the per-tensor lists to name the first
     * tensor that differs. */
    int64_t n = call->n;
    int64_t *lists = malloc((size_t)p * (size_t)n * 3 * sizeof *lists + 1);
    int64_t *own = malloc((size_t)n * 3 * sizeof *own + 1);
    if (!lists || !own) {
      free(lists); free(own); free(all);
      return gs_fail(GS_ERR_NO_MEMORY, "validation: out of memory");
    }
    for (int64_t i = 0; i < n; i++) {
      own[3 * i] = call->tensors[i].dtype;
      own[3 * i + 1] = call->counts_vary ? 0 : call->tensors[i].count;
      own[3 * i + 2] = call->extra ? call->extra[i] : 0;
    }
    /* n*3 may pass int range only for absurd lists; gather bytes in chunks. */
    e = MPI_Allgather(own, (int)(n * 3), MPI_INT64_T, lists, (int)(n * 3), MPI_INT64_T, c->mpi);
    if (e != MPI_SUCCESS) status = gs_mpi_fail(e, "validation MPI_Allgather");
    for (int64_t i = 0; i < n && e == MPI_SUCCESS && !msg[0]; i++) {
      static const char *const what_of[3] = {"dtype", "element count", NULL};
      for (int k = 0; k < 3 && !msg[0]; k++) {
        int diff = 0;
        for (int r = 1; r < p; r++)
          if (lists[((size_t)r * n + i) * 3 + k] != lists[(size_t)i * 3 + k]) diff = 1;
        if (!diff) continue;
        char what[160];
        snprintf(what, sizeof what, "%s: the %s of tensor %lld", name,
                 what_of[k] ? what_of[k] : (call->extra_name ? call->extra_name : "shape"),
                 (long long)i);
        describe(msg, sizeof msg, what, lists + (size_t)i * 3 + k, (size_t)n * 3, p,
                 k == 0 ? name_dtype : name_int);
      }
    }
    if (!msg[0] && e == MPI_SUCCESS)
      snprintf(msg, sizeof msg, "%s: the ranks' calls differ (signature hash)", name);
    free(lists);
    free(own);
  }
  free(all);
  if (local != GS_SUCCESS) return local; /* keep this rank's own error message */
  if (status == GS_ERR_MISMATCH) gs_fail(GS_ERR_MISMATCH, "%s", msg);
  return status;
}

gs_status_t gs_check_call(gs_comm_t c, const gs_call_t *call, gs_status_t local,
                          gs_payload_t *payload) {
  c->seq++;
  c->stats.validations++;
  check_msg_t msg;
  memset(&msg, 0, sizeof msg);
  int64_t *v = msg.sig;
  v[F_KIND] = call->kind;
  v[F_OP] = call->op;
  v[F_ROOT] = call->root;
  v[F_N] = call->n;
  v[F_HASH] = local == GS_SUCCESS ? (int64_t)tensor_hash(call) : 0;
  v[F_THRESHOLD] = c->fusion_threshold;
  v[F_DIRECT] = c->direct_bytes;
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
  char saved[REASON_LEN] = "";
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
  return explain(c, call, local);
}

gs_status_t gs_begin_call(gs_comm_t c, const gs_call_t *call, gs_status_t local) {
  c->stats.calls++;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG, "%s: %lld tensors, %lld bytes, op %s", gs_call_name(call->kind),
           (long long)call->n, (long long)call_bytes(call), gs_op_name(call->op));
  if (!c->check) return local;
  double t0 = GS_TL_START();
  gs_status_t s = gs_check_call(c, call, local, NULL);
  GS_TL_END("validate", gs_call_name(call->kind), 0, t0, call_bytes(call));
  return s;
}
