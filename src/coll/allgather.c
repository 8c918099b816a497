/* Fused allgather with a variable dim 0 per rank, in two steps: the ranks
 * first exchange counts (so callers can allocate), then gather. */
#include <stdlib.h>

#include "coll/gs_collective.h"

/* gs_allgather_counts (d->counts: row sizes, may be NULL) and
 * gs_allgather_rows (d->counts2: rows, with the row sizes) share one path. */
static gs_status_t counts_check(gs_comm_t c, gs_coll_t *d) {
  const int64_t *row_elems = d->counts, *rows = d->counts2;
  if (d->n > 0 && !d->extra)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", d->fn,
                   d->kind == GS_CALL_ALLGATHER_ROWS ? "rows_out" : "counts_out");
  if (d->kind == GS_CALL_ALLGATHER_ROWS && d->n > 0 && (!rows || !row_elems))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s is NULL", d->fn, rows ? "row_elems" : "rows");
  for (int64_t i = 0; rows && i < d->n; i++)
    if (rows[i] < 0 || row_elems[i] < 0 || rows[i] * row_elems[i] != d->in[i].count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: in[%lld] has %lld elements, not %lld rows of %lld", d->fn, (long long)i,
                     (long long)d->in[i].count, (long long)rows[i], (long long)row_elems[i]);
  for (int64_t i = 0; !rows && row_elems && i < d->n; i++)
    if (row_elems[i] <= 0 || d->in[i].count % row_elems[i] != 0)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: in[%lld] has %lld elements, not a whole number of rows of %lld", d->fn,
                     (long long)i, (long long)d->in[i].count, (long long)row_elems[i]);
  gs_coll_counts_only(d, row_elems);
  return GS_SUCCESS;
}

/* Every rank's element counts (or rows), rank-major, into d->extra. */
static gs_status_t counts_run(const gs_engine_t *e, gs_coll_t *d) {
  (void)e;
  gs_comm_t c = d->comm;
  int64_t n = d->n, *counts_out = d->extra;
  if (n > 0x7fffffff) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: too many tensors", d->fn);
  int64_t *mine = malloc((size_t)n * sizeof *mine);
  if (!mine) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  for (int64_t i = 0; i < n; i++) mine[i] = d->counts2 ? d->counts2[i] : d->in[i].count;
  MPI_Request req;
  int err =
      MPI_Iallgather(mine, (int)n, MPI_INT64_T, counts_out, (int)n, MPI_INT64_T, c->mpi, &req);
  gs_status_t s = err == MPI_SUCCESS
                      ? gs_mpi_wait(&req, "allgather counts: MPI_Iallgather", NULL, NULL)
                      : gs_mpi_fail(err, "allgather counts: MPI_Iallgather");
  free(mine);
  return s;
}

/* Gathers one message. Layout in `recv`: rank-major blocks; inside rank r's
 * block, that rank's pieces of the message's tensors in slot order. */
static gs_status_t gather_blocks(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                 const gs_coll_t *d, int64_t *bcounts, int64_t *displs) {
  gs_comm_t c = e->comm;
  const gs_tensor_t *in = d->in, *out = d->out;
  const int64_t *counts = d->counts;
  int64_t n = d->n;
  int p = c->size;
  size_t es = gs_dtype_size(m->dtype);
  for (int r = 0; r < p; r++) {
    bcounts[r] = 0;
    for (int64_t k = m->first; k < m->first + m->nslots; k++)
      bcounts[r] += counts[(size_t)r * n + plan->slots[k].tensor];
    displs[r] = r ? displs[r - 1] + bcounts[r - 1] : 0;
  }
  if (m->nslots == 1) { /* one tensor: its output already has the layout */
    int64_t t = plan->slots[m->first].tensor;
    gs_copy_t mine = {gs_at(out[t].data, (size_t)displs[c->rank] * es), in[t].data,
                      bcounts[c->rank]};
    GS_CHECK(gs_copy_batch(e, m->dtype, &mine, 1, 1.0));
    double t0 = GS_TL_START();
    gs_status_t s = e->transport->allgatherv(c, out[t].data, bcounts, displs, m->dtype);
    GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
    return s;
  }
  void *buf = NULL;
  GS_CHECK(gs_buffer_reserve(e, (size_t)m->count * es, &buf));
  /* every copy in and out of the buffer, as two batches */
  gs_copy_t *copies = malloc((size_t)(p + 1) * (size_t)m->nslots * sizeof *copies);
  if (!copies) return gs_fail(GS_ERR_NO_MEMORY, "gs_allgatherv: out of memory");
  char *mine = (char *)buf + (size_t)displs[c->rank] * es;
  int64_t nc = 0;
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    int64_t t = plan->slots[k].tensor;
    copies[nc++] = (gs_copy_t){mine, in[t].data, in[t].count};
    mine += (size_t)in[t].count * es;
  }
  gs_status_t s = gs_copy_batch(e, m->dtype, copies, nc, 1.0);
  double t0 = GS_TL_START();
  if (s == GS_SUCCESS) s = e->transport->allgatherv(c, buf, bcounts, displs, m->dtype);
  GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
  nc = 0;
  for (int r = 0; r < p && s == GS_SUCCESS; r++) {
    const char *src = (const char *)buf + (size_t)displs[r] * es;
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      int64_t t = plan->slots[k].tensor;
      int64_t before = 0; /* rows of tensor t from ranks below r */
      for (int q = 0; q < r; q++) before += counts[(size_t)q * n + t];
      int64_t cnt = counts[(size_t)r * n + t];
      copies[nc++] = (gs_copy_t){gs_at(out[t].data, cnt ? (size_t)before * es : 0), src, cnt};
      src += (size_t)cnt * es;
    }
  }
  if (s == GS_SUCCESS) s = gs_copy_batch(e, m->dtype, copies, nc, 1.0);
  free(copies);
  return s;
}

/* Per message, with room for its block counts and displacements. */
static gs_status_t gather_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, gs_coll_t *d) {
  int p = e->comm->size;
  int64_t *scratch = malloc(2 * (size_t)p * sizeof *scratch);
  if (!scratch) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  gs_status_t s = gather_blocks(e, plan, m, d, scratch, scratch + p);
  free(scratch);
  return s;
}

static gs_status_t allgatherv_check(gs_comm_t c, gs_coll_t *d) {
  const gs_tensor_t *in = d->in, *out = d->out;
  const int64_t *counts = d->counts;
  const char *fn = d->fn;
  if (d->n > 0 && !counts) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts is NULL", fn);
  for (int64_t i = 0; i < d->n; i++) {
    int64_t sum = 0, n = d->n;
    for (int r = 0; r < c->size; r++) sum += counts[(size_t)r * n + i];
    if (out[i].dtype != in[i].dtype)
      return gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                     gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
    if (counts[(size_t)c->rank * n + i] != in[i].count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: counts says this rank has %lld elements "
                     "of tensor %lld, in[%lld] has %lld",
                     fn, (long long)counts[(size_t)c->rank * n + i], (long long)i, (long long)i,
                     (long long)in[i].count);
    if (out[i].count != sum)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: out[%lld] has %lld elements, the gathered "
                     "tensor has %lld",
                     fn, (long long)i, (long long)out[i].count, (long long)sum);
  }
  /* a device copy of in into out races where a host memmove did not */
  if (d->n > 0 && out[0].device.kind == GS_DEVICE_CUDA)
    GS_CHECK(gs_check_disjoint(fn, in, out, d->n));
  d->call.tensors = out;
  d->plan_on = d->memory = out;
  return GS_SUCCESS;
}

gs_status_t gs_allgather_counts(gs_comm_t c, const gs_tensor_t *in, int64_t n,
                                const int64_t *row_elems, int64_t *counts_out) {
  gs_coll_t d = {.fn = "gs_allgather_counts",
                 .name = "allgather",
                 .kind = GS_CALL_ALLGATHER_COUNTS,
                 .in = in,
                 .n = n,
                 .op = GS_OP_SUM,
                 .counts = row_elems,
                 .extra = counts_out,
                 .check = counts_check,
                 .run = counts_run};
  return gs_collective(c, &d);
}

gs_status_t gs_allgather_rows(gs_comm_t c, const gs_tensor_t *in, int64_t n, const int64_t *rows,
                              const int64_t *row_elems, int64_t *rows_out) {
  gs_coll_t d = {.fn = "gs_allgather_rows",
                 .name = "allgather",
                 .kind = GS_CALL_ALLGATHER_ROWS,
                 .in = in,
                 .n = n,
                 .op = GS_OP_SUM,
                 .counts = row_elems,
                 .counts2 = rows,
                 .extra = rows_out,
                 .check = counts_check,
                 .run = counts_run};
  return gs_collective(c, &d);
}

gs_status_t gs_allgatherv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                          const int64_t *counts) {
  gs_coll_t d = {.fn = "gs_allgatherv",
                 .name = "allgather",
                 .kind = GS_CALL_ALLGATHERV,
                 .out_required = 1,
                 .in = in,
                 .out = out,
                 .n = n,
                 .op = GS_OP_SUM,
                 .counts = counts,
                 .check = allgatherv_check,
                 .message = gather_message};
  return gs_collective(c, &d);
}
