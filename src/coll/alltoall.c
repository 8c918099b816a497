/* All-to-all with per-destination counts, in two steps like allgather: the
 * ranks may first exchange counts (gs_alltoall_counts), then the data.
 *
 * Validation of gs_alltoallv: the usual check (call, tensor count, dtypes)
 * carries one more thing in its message, summed over the ranks: every rank
 * adds a hash of each (sender, receiver, tensor, count) it will send and
 * subtracts one of each it expects to receive. The sum is zero exactly when
 * the ranks' counts agree (barring a 64-bit hash collision), so a mismatch
 * is found on every rank before any data moves, at no extra message. The
 * same sum says whether any rank needs counts past MPI's int, so all ranks
 * pick the same algorithm. */
#include <stdlib.h>
#include <string.h>

#include "coll/gs_collective.h"

static gs_status_t counts_check(gs_comm_t c, gs_coll_t *d) {
  const int64_t *send = d->counts, *recv = d->counts2;
  int64_t n = d->n;
  if (n > 0 && (!send || !recv))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", d->fn,
                   send ? "recv_counts" : "send_counts");
  if (n > 0x7fffffff)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: too many tensors (%lld)", d->fn, (long long)n);
  for (int64_t k = 0; k < n * c->size; k++)
    if (send[k] < 0)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: send_counts[%lld] (tensor %lld to rank "
                     "%lld) is negative: %lld",
                     d->fn, (long long)k, (long long)(k % n), (long long)(k / n),
                     (long long)send[k]);
  gs_coll_counts_only(d, d->extra); /* extra: the row sizes */
  return GS_SUCCESS;
}

static gs_status_t counts_run(const gs_engine_t *e, gs_coll_t *d) {
  (void)e;
  MPI_Request req;
  int err = MPI_Ialltoall(d->counts, (int)d->n, MPI_INT64_T, (void *)d->counts2, (int)d->n,
                          MPI_INT64_T, d->comm->mpi, &req);
  if (err != MPI_SUCCESS) return gs_mpi_fail(err, "gs_alltoall_counts: MPI_Ialltoall");
  return gs_mpi_wait(&req, "gs_alltoall_counts: MPI_Ialltoall", NULL, NULL);
}

static uint64_t edge_hash(int64_t from, int64_t to, int64_t tensor, int64_t count) {
  uint64_t h = gs_hash_mix(0x616c6c746f616c6cull, (uint64_t)from);
  h = gs_hash_mix(h, (uint64_t)to);
  h = gs_hash_mix(h, (uint64_t)tensor);
  return gs_hash_mix(h, (uint64_t)count);
}

static gs_status_t check_counts(const char *fn, const gs_tensor_t *t, const int64_t *counts,
                                int64_t n, int p, const char *tname, const char *cname) {
  for (int64_t i = 0; i < n; i++) {
    int64_t sum;
    GS_CHECK(gs_check_column(fn, cname, counts, n, p, i, &sum, NULL));
    if (sum != t[i].count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: %s[%lld] has %lld elements but %s add up to %lld for it", fn, tname,
                     (long long)i, (long long)t[i].count, cname, (long long)sum);
  }
  return GS_SUCCESS;
}

/* Every rank learns every rank's counts and names the first disagreement
 * (only after the check found one). */
static gs_status_t explain_counts(gs_comm_t c, int64_t n, const int64_t *send,
                                  const int64_t *recv) {
  int p = c->size;
  size_t per = 2 * (size_t)n * (size_t)p;
  int64_t *mine = malloc(per * sizeof *mine), *all = malloc(per * (size_t)p * sizeof *all);
  gs_status_t s =
      mine && all ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "gs_alltoallv: out of memory");
  if (s == GS_SUCCESS) {
    memcpy(mine, send, per / 2 * sizeof *mine);
    memcpy(mine + per / 2, recv, per / 2 * sizeof *mine);
    int e = MPI_Allgather(mine, (int)per, MPI_INT64_T, all, (int)per, MPI_INT64_T, c->mpi);
    if (e != MPI_SUCCESS) s = gs_mpi_fail(e, "gs_alltoallv: gathering counts");
  }
  for (int from = 0; s == GS_SUCCESS && from < p; from++)
    for (int to = 0; to < p; to++)
      for (int64_t i = 0; i < n; i++) {
        int64_t sent = all[from * per + (size_t)to * n + i];
        int64_t expected = all[to * per + per / 2 + (size_t)from * n + i];
        if (sent == expected) continue;
        free(mine);
        free(all);
        return gs_fail(GS_ERR_MISMATCH,
                       "alltoallv: the ranks' counts disagree: rank %d sends "
                       "%lld elements of tensor %lld to rank %d, which expects %lld from rank %d",
                       from, (long long)sent, (long long)i, to, (long long)expected, from);
      }
  free(mine);
  free(all);
  return s == GS_SUCCESS ? gs_fail(GS_ERR_MISMATCH, "alltoallv: the ranks' counts disagree") : s;
}

/* Meets the other ranks: the check with the counts' hash sum riding in it
 * (validation on), else only the agreement on the algorithm. *native: MPI's
 * own alltoallv carries every rank's counts. */
static gs_status_t agree(gs_comm_t c, gs_coll_t *d, gs_status_t local) {
  const gs_call_t *call = &d->call;
  const gs_tensor_t *out = d->out;
  const int64_t *send = d->counts, *recv = d->counts2;
  int *native = d->extra;
  int64_t n = call->n, limit = gs_env_mpi_max_count();
  int64_t sums[2] = {0, 0}; /* hash balance, ranks needing 64-bit counts */
  uint64_t balance = 0;      /* unsigned: wraps by definition */
  for (int64_t i = 0; local == GS_SUCCESS && i < n; i++) {
    for (int r = 0; r < c->size; r++)
      balance += edge_hash(c->rank, r, i, send[(size_t)r * n + i]) -
                 edge_hash(r, c->rank, i, recv[(size_t)r * n + i]);
    if (call->tensors[i].count > limit || out[i].count > limit) sums[1] = 1;
  }
  memcpy(&sums[0], &balance, sizeof balance);
  c->stats.calls++;
  if (c->check) {
    gs_payload_t payload = {sums, 2, GS_INT64, GS_OP_SUM, NULL};
    double t0 = GS_TL_START();
    gs_status_t s = gs_check_call(c, call, local, &payload);
    GS_TL_END("validate", "alltoallv", 0, t0, 0);
    if (s != GS_SUCCESS) return s;
    if (sums[0] != 0) return explain_counts(c, n, send, recv);
  } else {
    if (local != GS_SUCCESS) return local;
    GS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &sums[1], 1, MPI_INT64_T, MPI_MAX, c->mpi),
                 "gs_alltoallv: agreeing on the algorithm");
  }
  *native = sums[1] == 0;
  return GS_SUCCESS;
}

static gs_status_t alltoallv_check(gs_comm_t c, gs_coll_t *d) {
  const gs_tensor_t *in = d->in, *out = d->out;
  const char *fn = d->fn;
  int64_t n = d->n;
  if (n > 0 && (!d->counts || !d->counts2))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn,
                   d->counts ? "recv_counts" : "send_counts");
  for (int64_t i = 0; i < n; i++)
    if (out[i].dtype != in[i].dtype)
      return gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                     gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
  GS_CHECK(check_counts(fn, in, d->counts, n, c->size, "in", "send_counts"));
  GS_CHECK(check_counts(fn, out, d->counts2, n, c->size, "out", "recv_counts"));
  d->call.counts_vary = 1; /* element counts differ by rank by nature; the hash sum checks them */
  return gs_check_disjoint(fn, in, out, n);
}

/* Each tensor its own exchange, with its column of counts. */
static gs_status_t alltoallv_run(const gs_engine_t *e, gs_coll_t *d) {
  int p = e->comm->size, *native = d->extra;
  int64_t n = d->n;
  int64_t *v = malloc(4 * (size_t)p * sizeof *v);
  gs_status_t s = v ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    gs_xfer_t x = {
        d->in[i].dtype, 0, d->in[i].data, d->out[i].data, v, v + p, v + 2 * p, v + 3 * p, 0, 0,
        *native};
    for (int r = 0; r < p; r++) {
      v[r] = d->counts[(size_t)r * n + i];
      v[p + r] = r ? v[p + r - 1] + v[r - 1] : 0;
      v[2 * p + r] = d->counts2[(size_t)r * n + i];
      v[3 * p + r] = r ? v[3 * p + r - 1] + v[2 * p + r - 1] : 0;
    }
    s = gs_xfer_alltoallv(e, &x);
  }
  free(v);
  return s;
}

gs_status_t gs_alltoall_counts(gs_comm_t c, const gs_tensor_t *in, int64_t n,
                               const int64_t *row_elems, const int64_t *send_counts,
                               int64_t *recv_counts) {
  gs_coll_t d = {.fn = "gs_alltoall_counts",
                 .name = "alltoall_counts",
                 .kind = GS_CALL_ALLTOALL_COUNTS,
                 .in = in,
                 .n = n,
                 .op = GS_OP_SUM,
                 .counts = send_counts,
                 .counts2 = recv_counts,
                 .extra = (void *)row_elems,
                 .check = counts_check,
                 .run = counts_run};
  return gs_collective(c, &d);
}

gs_status_t gs_alltoallv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                         const int64_t *send_counts, const int64_t *recv_counts) {
  int native = 1;
  gs_coll_t d = {.fn = "gs_alltoallv",
                 .name = "alltoallv",
                 .kind = GS_CALL_ALLTOALLV,
                 .out_required = 1,
                 .in = in,
                 .out = out,
                 .n = n,
                 .op = GS_OP_SUM,
                 .counts = send_counts,
                 .counts2 = recv_counts,
                 .extra = &native,
                 .check = alltoallv_check,
                 .validate = agree,
                 .run = alltoallv_run};
  return gs_collective(c, &d);
}
