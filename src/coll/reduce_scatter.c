/* Fused reduce_scatter: rank r keeps block r of dim 0 of each reduced tensor,
 * with the balanced split rows / size + (r < rows % size). */
#include <stdlib.h>

#include "coll/gs_collective.h"

gs_status_t gs_block_range(int64_t rows, int64_t row_elems, int size, int rank, int64_t *first,
                           int64_t *count) {
  if (rows < 0 || row_elems < 0 || size <= 0 || rank < 0 || rank >= size || !first || !count)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_block_range: invalid arguments");
  if (row_elems > 0 && rows > INT64_MAX / row_elems)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_block_range: %lld rows of %lld elements do "
                   "not fit in 64 bits",
                   (long long)rows, (long long)row_elems);
  int64_t q = rows / size, rem = rows % size;
  *first = (rank * q + (rank < rem ? rank : rem)) * row_elems;
  *count = (q + (rank < rem)) * row_elems;
  return GS_SUCCESS;
}

static int64_t row_elems_of(const gs_tensor_t *t, const int64_t *rows, int64_t i) {
  int64_t r = rows ? rows[i] : t[i].count;
  return r ? t[i].count / r : 0;
}

static gs_status_t scatter_blocks(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_coll_t *d, int64_t *bcounts) {
  gs_comm_t c = e->comm;
  const gs_tensor_t *in = d->in, *out = d->out;
  const int64_t *rows = d->counts;
  gs_op_t op = d->op;
  double pre = d->pre, post = d->post;
  int p = c->size;
  size_t es = gs_dtype_size(m->dtype);
  int64_t first, cnt;
  for (int r = 0; r < p; r++) {
    bcounts[r] = 0;
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      int64_t t = plan->slots[k].tensor;
      gs_block_range(rows ? rows[t] : in[t].count, row_elems_of(in, rows, t), p, r, &first, &cnt);
      bcounts[r] += cnt;
    }
  }
  if (m->nslots == 1 && pre == 1.0) { /* one tensor: already rank-major */
    int64_t t = plan->slots[m->first].tensor;
    double t0 = GS_TL_START();
    GS_CHECK(e->transport->reduce_scatter(c, in[t].data, out[t].data, bcounts, m->dtype, op));
    GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
    return gs_scale_copy(e, m->dtype, out[t].data, out[t].data, post == 1.0 ? 0 : out[t].count,
                         post);
  }
  size_t send_bytes = ((size_t)m->count * es + 63) & ~(size_t)63;
  void *buf = NULL;
  GS_CHECK(gs_buffer_reserve(e, send_bytes + (size_t)bcounts[c->rank] * es, &buf));
  gs_copy_t *copies = malloc((size_t)p * (size_t)m->nslots * sizeof *copies);
  if (!copies) return gs_fail(GS_ERR_NO_MEMORY, "gs_reduce_scatter: out of memory");
  char *dst = buf, *recv = (char *)buf + send_bytes;
  int64_t nc = 0;
  for (int r = 0; r < p; r++)
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      int64_t t = plan->slots[k].tensor;
      gs_block_range(rows ? rows[t] : in[t].count, row_elems_of(in, rows, t), p, r, &first, &cnt);
      copies[nc++] = (gs_copy_t){dst, gs_at(in[t].data, cnt ? (size_t)first * es : 0), cnt};
      dst += (size_t)cnt * es;
    }
  gs_status_t s = gs_copy_batch(e, m->dtype, copies, nc, pre);
  double t0 = GS_TL_START();
  if (s == GS_SUCCESS) s = e->transport->reduce_scatter(c, buf, recv, bcounts, m->dtype, op);
  GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
  nc = 0;
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    int64_t t = plan->slots[k].tensor;
    copies[nc++] = (gs_copy_t){out[t].data, recv, out[t].count};
    recv += (size_t)out[t].count * es;
  }
  if (s == GS_SUCCESS) s = gs_copy_batch(e, m->dtype, copies, nc, post);
  free(copies);
  return s;
}

static gs_status_t scatter_message(const gs_engine_t *e, const gs_plan_t *plan,
                                   const gs_message_t *m, gs_coll_t *d) {
  int64_t *bcounts = malloc((size_t)e->comm->size * sizeof *bcounts);
  if (!bcounts) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  gs_status_t s = scatter_blocks(e, plan, m, d, bcounts);
  free(bcounts);
  return s;
}

static gs_status_t reduce_scatter_check(gs_comm_t c, gs_coll_t *d) {
  const gs_tensor_t *in = d->in, *out = d->out;
  const int64_t *rows = d->counts;
  const char *fn = d->fn;
  for (int64_t i = 0; i < d->n; i++) {
    int64_t r = rows ? rows[i] : in[i].count, first, cnt;
    if (r < 0 || (r == 0 && in[i].count != 0) || (r > 0 && in[i].count % r != 0))
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: in[%lld] has %lld elements, not %lld whole "
                     "rows",
                     fn, (long long)i, (long long)in[i].count, (long long)r);
    gs_block_range(r, row_elems_of(in, rows, i), c->size, c->rank, &first, &cnt);
    if (out[i].dtype != in[i].dtype)
      return gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                     gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
    if (out[i].count != cnt)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: out[%lld] has %lld elements; this rank's "
                     "block has %lld",
                     fn, (long long)i, (long long)out[i].count, (long long)cnt);
  }
  d->call.extra = rows;
  d->call.extra_name = "number of rows";
  return gs_check_disjoint(fn, in, out, d->n);
}

gs_status_t gs_reduce_scatter(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                              const int64_t *rows, gs_op_t op, double prescale, double postscale) {
  gs_coll_t d = {.fn = "gs_reduce_scatter",
                 .name = "reduce_scatter",
                 .kind = GS_CALL_REDUCE_SCATTER,
                 .out_required = 1,
                 .in = in,
                 .out = out,
                 .n = n,
                 .op = op,
                 .pre = prescale,
                 .post = postscale,
                 .counts = rows,
                 .op_checked = 1,
                 .check = reduce_scatter_check,
                 .message = scatter_message};
  return gs_collective(c, &d);
}
