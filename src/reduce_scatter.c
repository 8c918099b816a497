/* Fused reduce_scatter: rank r keeps block r of dim 0 of each reduced tensor,
 * with the balanced split rows / size + (r < rows % size). */
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

gs_status_t gs_block_range(int64_t rows, int64_t row_elems, int size, int rank,
                           int64_t *first, int64_t *count) {
  if (rows < 0 || row_elems < 0 || size <= 0 || rank < 0 || rank >= size || !first || !count)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_block_range: invalid arguments");
  int64_t q = rows / size, rem = rows % size;
  *first = (rank * q + (rank < rem ? rank : rem)) * row_elems;
  *count = (q + (rank < rem)) * row_elems;
  return GS_SUCCESS;
}

static int64_t row_elems_of(const gs_tensor_t *t, const int64_t *rows, int64_t i) {
  int64_t r = rows ? rows[i] : t[i].count;
  return r ? t[i].count / r : 0;
}

static gs_status_t scatter_message(gs_comm_t c, const gs_plan_t *plan, const gs_message_t *m,
                                   const gs_tensor_t *in, const gs_tensor_t *out,
                                   const int64_t *rows, gs_op_t op, double pre, double post,
                                   int64_t *bcounts) {
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
    GS_CHECK(gs_mpi_transport.reduce_scatter(c, in[t].data, out[t].data, bcounts, m->dtype, op));
    gs_cpu_scale_copy(m->dtype, out[t].data, out[t].data, post == 1.0 ? 0 : out[t].count, post);
    return GS_SUCCESS;
  }
  size_t send_bytes = ((size_t)m->count * es + 63) & ~(size_t)63;
  void *buf = NULL;
  GS_CHECK(gs_fusion_reserve(c, send_bytes + (size_t)bcounts[c->rank] * es, &buf));
  char *dst = buf, *recv = (char *)buf + send_bytes;
  for (int r = 0; r < p; r++)
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      int64_t t = plan->slots[k].tensor;
      gs_block_range(rows ? rows[t] : in[t].count, row_elems_of(in, rows, t), p, r, &first, &cnt);
      gs_cpu_scale_copy(m->dtype, (const char *)in[t].data + (size_t)first * es, dst, cnt, pre);
      dst += (size_t)cnt * es;
    }
  GS_CHECK(gs_mpi_transport.reduce_scatter(c, buf, recv, bcounts, m->dtype, op));
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    int64_t t = plan->slots[k].tensor;
    gs_cpu_scale_copy(m->dtype, recv, out[t].data, out[t].count, post);
    recv += (size_t)out[t].count * es;
  }
  return GS_SUCCESS;
}

gs_status_t gs_reduce_scatter(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                              int64_t n, const int64_t *rows, gs_op_t op, double prescale,
                              double postscale) {
  static const char fn[] = "gs_reduce_scatter";
  GS_CHECK(gs_comm_valid(c, fn));
  gs_clear_error();
  gs_status_t local = gs_check_tensors(fn, "in", in, n);
  if (local == GS_SUCCESS) local = gs_check_tensors(fn, "out", out, n);
  if (local == GS_SUCCESS) local = gs_check_op(fn, op, in, n, prescale, postscale, 0);
  for (int64_t i = 0; local == GS_SUCCESS && i < n; i++) {
    int64_t r = rows ? rows[i] : in[i].count, first, cnt;
    if (r < 0 || (r == 0 && in[i].count != 0) || (r > 0 && in[i].count % r != 0)) {
      local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: in[%lld] has %lld elements, not %lld whole rows",
                      fn, (long long)i, (long long)in[i].count, (long long)r);
      break;
    }
    gs_block_range(r, row_elems_of(in, rows, i), c->size, c->rank, &first, &cnt);
    if (out[i].dtype != in[i].dtype)
      local = gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                      gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
    else if (out[i].count != cnt)
      local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: out[%lld] has %lld elements; this rank's "
                      "block has %lld", fn, (long long)i, (long long)out[i].count, (long long)cnt);
  }
  gs_call_t call = {GS_CALL_REDUCE_SCATTER, op, 0, n, in, rows, "number of rows", 0};
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;

  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, in, n, c));
  int64_t *bcounts = malloc((size_t)c->size * sizeof *bcounts);
  gs_status_t s = bcounts ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  double post = op == GS_OP_AVERAGE ? postscale * (1.0 / c->size) : postscale;
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++)
    if (plan.msgs[k].count > 0)
      s = scatter_message(c, &plan, &plan.msgs[k], in, out, rows, op, prescale, post, bcounts);
  free(bcounts);
  gs_plan_free(&plan);
  return s;
}
