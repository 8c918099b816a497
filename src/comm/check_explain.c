/* Describing calls: their names, signature hashes and sizes; and explaining
 * a validation mismatch, where the ranks gather full records and every rank
 * builds the same message naming what differs and on which ranks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/gs_comm_internal.h"

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
    case GS_CALL_ALLGATHER_ROWS: return "allgather (rows)";
  }
  return "unknown";
}

uint64_t gs_check_hash(const gs_call_t *call) {
  uint64_t h = 0x6772616473796e63ull;
  /* host or CUDA memory: ranks must agree (the paths differ) */
  if (call->n) h = gs_hash_mix(h, call->tensors[0].device.kind == GS_DEVICE_CUDA ? 2u : 1u);
  for (int64_t i = 0; i < call->n; i++) {
    h = gs_hash_mix(h, (uint64_t)call->tensors[i].dtype);
    if (!call->counts_vary) h = gs_hash_mix(h, (uint64_t)call->tensors[i].count);
    if (call->extra) h = gs_hash_mix(h, (uint64_t)call->extra[i]);
  }
  return h & 0x3fffffffffffffffull; /* keep it positive: its negation is sent too */
}

void gs_check_fields(gs_comm_t c, const gs_call_t *call, gs_status_t local, int64_t *v) {
  v[F_KIND] = call->kind;
  v[F_OP] = call->op;
  v[F_ROOT] = call->root;
  v[F_N] = call->n;
  v[F_HASH] = local == GS_SUCCESS ? (int64_t)gs_check_hash(call) : 0;
  v[F_THRESHOLD] = c->fusion_threshold;
  v[F_DIRECT] = c->direct_bytes;
  v[F_PIPELINE] = c->pipeline_bytes;
  v[F_CMA] = c->cma_bytes; /* whether a large call reads the peers: all or none */
  v[F_TAG_HI] = (int64_t)(call->tag >> 32);
  v[F_TAG_LO] = (int64_t)(call->tag & 0xffffffffu);
  v[F_ERROR] = local != GS_SUCCESS;
  v[F_PAYLOAD] = 0;
}

int64_t gs_call_bytes(const gs_call_t *call) {
  int64_t b = 0;
  for (int64_t i = 0; i < call->n; i++)
    b += call->tensors[i].count * (int64_t)gs_dtype_size(call->tensors[i].dtype);
  return b;
}

typedef struct record {
  int64_t f[NFIELDS];
  char reason[GS_REASON_LEN];
} record_t;

/* Appends "a,b,c-f" for the ranks with mark[r] == want. */
void gs_format_ranks(char *buf, size_t cap, const unsigned char *mark, int p, int want) {
  size_t len = strlen(buf);
  int first = 1;
  for (int r = 0; r < p && len + 24 < cap; r++) {
    if (mark[r] != want) continue;
    int e = r;
    while (e + 1 < p && mark[e + 1] == want) e++;
    len +=
        (size_t)snprintf(buf + len, cap - len, e > r ? "%s%d-%d" : "%s%d", first ? "" : ",", r, e);
    first = 0;
    r = e;
  }
  if (first) snprintf(buf + len, cap - len, "none");
}

typedef const char *(*name_fn)(int64_t v, char *tmp, size_t cap);

static const char *name_int(int64_t v, char *tmp, size_t cap) {
  snprintf(tmp, cap, "%lld", (long long)v);
  return tmp;
}
static const char *name_tag(int64_t v, char *tmp, size_t cap) {
  snprintf(tmp, cap, "0x%016llx", (unsigned long long)v);
  return tmp;
}
static const char *name_kind(int64_t v, char *tmp, size_t cap) {
  (void)tmp;
  (void)cap;
  return gs_call_name((gs_call_kind_t)v);
}
static const char *name_op(int64_t v, char *tmp, size_t cap) {
  (void)tmp;
  (void)cap;
  return gs_op_name((gs_op_t)v);
}
static const char *name_dtype(int64_t v, char *tmp, size_t cap) {
  (void)tmp;
  (void)cap;
  return gs_dtype_name((gs_dtype_t)v);
}

/* "what differs: A on ranks 0-2; B on rank 3" for the values vals[r*stride]. */
static void describe(char *buf, size_t cap, const char *what, const int64_t *vals, size_t stride,
                     int p, name_fn name) {
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
    gs_format_ranks(buf, cap, mark, q, 1);
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
    {F_PIPELINE, "the pipeline piece size (bytes, GRADSYNC_PIPELINE_BYTES)", name_int},
    {F_CMA, "the smallest allreduce read from the peers (bytes, GRADSYNC_CMA_BYTES)", name_int},
};

static const struct scalar_field *first_scalar_difference(const int *differs) {
  for (size_t k = 0; k < sizeof scalar_fields / sizeof scalar_fields[0]; k++)
    if (differs[scalar_fields[k].field]) return &scalar_fields[k];
  return NULL;
}

/* Some rank rejected its arguments: name the ranks and the first one's reason. */
static void explain_error(const record_t *all, int p, const char *name, char *msg, size_t cap) {
  int first = -1;
  unsigned char mark[4096] = {0};
  int q = p < 4096 ? p : 4096;
  for (int r = 0; r < q; r++) {
    mark[r] = all[r].f[F_ERROR] != 0;
    if (mark[r] && first < 0) first = r;
  }
  char who[512] = "";
  gs_format_ranks(who, sizeof who, mark, q, 1);
  snprintf(msg, cap, "%s: rank(s) %s rejected their arguments (rank %d: %s)", name, who, first,
           first >= 0 ? all[first].reason : "");
}

/* The call tags differ (gs_set_call_options): each rank's whole tag. */
static void explain_tag(const record_t *all, int p, const char *name, char *msg, size_t cap) {
  int64_t *tags = malloc((size_t)p * sizeof *tags);
  if (!tags) {
    snprintf(msg, cap, "%s: the call tag differs across ranks", name);
    return;
  }
  for (int r = 0; r < p; r++)
    tags[r] = (int64_t)(((uint64_t)all[r].f[F_TAG_HI] << 32) | (uint64_t)all[r].f[F_TAG_LO]);
  char what[160];
  snprintf(what, sizeof what, "%s: the call tag", name);
  describe(msg, cap, what, tags, 1, p, name_tag);
  free(tags);
}

/* Same count everywhere: gather the per-tensor lists to name the first
 * tensor that differs. */
static gs_status_t explain_tensors(gs_comm_t c, const gs_call_t *call, const char *name, char *msg,
                                   size_t cap) {
  int p = c->size;
  int64_t n = call->n;
  int64_t *lists = malloc((size_t)p * (size_t)n * 3 * sizeof *lists + 1);
  int64_t *own = malloc((size_t)n * 3 * sizeof *own + 1);
  gs_status_t status = GS_ERR_MISMATCH;
  if (!lists || !own) status = gs_fail(GS_ERR_NO_MEMORY, "validation: out of memory");
  for (int64_t i = 0; status == GS_ERR_MISMATCH && i < n; i++) {
    own[3 * i] = call->tensors[i].dtype;
    own[3 * i + 1] = call->counts_vary ? 0 : call->tensors[i].count;
    own[3 * i + 2] = call->extra ? call->extra[i] : 0;
  }
  int e = status == GS_ERR_MISMATCH ? MPI_Allgather(own, (int)(n * 3), MPI_INT64_T, lists,
                                                    (int)(n * 3), MPI_INT64_T, c->mpi)
                                    : MPI_SUCCESS;
  if (e != MPI_SUCCESS) status = gs_mpi_fail(e, "validation MPI_Allgather");
  static const char *const what_of[3] = {"dtype", "element count", NULL};
  for (int64_t i = 0; status == GS_ERR_MISMATCH && i < n && !msg[0]; i++)
    for (int k = 0; k < 3 && !msg[0]; k++) {
      int diff = 0;
      for (int r = 1; r < p; r++)
        if (lists[((size_t)r * n + i) * 3 + k] != lists[(size_t)i * 3 + k]) diff = 1;
      if (!diff) continue;
      char what[160];
      snprintf(what, sizeof what, "%s: the %s of tensor %lld", name,
               what_of[k] ? what_of[k] : (call->extra_name ? call->extra_name : "shape"),
               (long long)i);
      describe(msg, cap, what, lists + (size_t)i * 3 + k, (size_t)n * 3, p,
               k == 0 ? name_dtype : name_int);
    }
  if (status == GS_ERR_MISMATCH && !msg[0])
    snprintf(msg, cap, "%s: the ranks' calls differ (signature hash)", name);
  free(lists);
  free(own);
  return status;
}

gs_status_t gs_check_explain(gs_comm_t c, const gs_call_t *call, gs_status_t local) {
  int p = c->size;
  record_t mine, *all = malloc((size_t)p * sizeof *all);
  if (!all) return gs_fail(GS_ERR_NO_MEMORY, "validation: out of memory");
  memset(&mine, 0, sizeof mine);
  gs_check_fields(c, call, local, mine.f); /* F_PAYLOAD 0: never the first difference */
  if (local != GS_SUCCESS) snprintf(mine.reason, GS_REASON_LEN, "%s", gs_last_error());
  int e = MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, c->mpi);
  if (e != MPI_SUCCESS) {
    free(all);
    return gs_mpi_fail(e, "validation MPI_Allgather");
  }
  char msg[2048] = "";
  const char *name = gs_call_name(call->kind);
  int differs[NFIELDS] = {0};
  for (int f = 0; f < NFIELDS; f++)
    for (int r = 1; r < p; r++)
      if (all[r].f[f] != all[0].f[f]) differs[f] = 1;
  gs_status_t status = GS_ERR_MISMATCH;
  const struct scalar_field *scalar;
  if (differs[F_ERROR] || all[0].f[F_ERROR]) {
    explain_error(all, p, name, msg, sizeof msg);
  } else if (!differs[F_KIND] && (differs[F_TAG_HI] || differs[F_TAG_LO])) {
    /* what the caller named the call (a Horovod operation's name) says more
     * than the tensors that differ with it */
    explain_tag(all, p, name, msg, sizeof msg);
  } else if ((scalar = first_scalar_difference(differs)) != NULL) {
    char what[160];
    /* The collective itself differs: naming this rank's would mislead. */
    snprintf(what, sizeof what, "%s%s%s", scalar->field == F_KIND ? "" : name,
             scalar->field == F_KIND ? "" : ": ", scalar->label);
    _Static_assert(sizeof(record_t) % sizeof(int64_t) == 0, "records are int64-strided");
    describe(msg, sizeof msg, what, &all[0].f[scalar->field], sizeof(record_t) / sizeof(int64_t), p,
             scalar->name);
  } else {
    status = explain_tensors(c, call, name, msg, sizeof msg);
  }
  free(all);
  if (local != GS_SUCCESS) return local; /* keep this rank's own error message */
  if (status == GS_ERR_MISMATCH) gs_fail(GS_ERR_MISMATCH, "%s", msg);
  return status;
}
