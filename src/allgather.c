/* Fused allgather with a variable dim 0 per rank, in two steps: the ranks
 * first exchange counts (so callers can allocate), then gather. */
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

static gs_status_t allgather_counts_impl(gs_comm_t c, const gs_tensor_t *in, int64_t n,
                                const int64_t *row_elems, int64_t *counts_out) {
  static const char fn[] = "gs_allgather_counts";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  gs_status_t local = gs_check_tensors(fn, "in", in, n);
  if (local == GS_SUCCESS && n > 0 && !counts_out)
    local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts_out is NULL", fn);
  for (int64_t i = 0; local == GS_SUCCESS && row_elems && i < n; i++)
    if (row_elems[i] <= 0 || in[i].count % row_elems[i] != 0)
      local = gs_fail(GS_ERR_INVALID_ARGUMENT,
                      "%s: in[%lld] has %lld elements, not a whole number of rows of %lld",
                      fn, (long long)i, (long long)in[i].count, (long long)row_elems[i]);
  gs_call_t call = {GS_CALL_ALLGATHER_COUNTS, GS_OP_SUM, 0, n, in, row_elems,
                    "row size (elements per row)", 1};
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;
  int64_t *mine = malloc((size_t)n * sizeof *mine);
  if (!mine) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  for (int64_t i = 0; i < n; i++) mine[i] = in[i].count;
  gs_status_t s = GS_SUCCESS;
  if (n > 0x7fffffff) s = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: too many tensors", fn);
  else {
    MPI_Request req;
    int e = MPI_Iallgather(mine, (int)n, MPI_INT64_T, counts_out, (int)n, MPI_INT64_T, c->mpi,
                           &req);
    s = e == MPI_SUCCESS ? gs_mpi_wait(&req, "gs_allgather_counts: MPI_Iallgather", NULL, NULL)
                         : gs_mpi_fail(e, "gs_allgather_counts: MPI_Iallgather");
  }
  free(mine);
  return s;
}

/* Gathers one message. Layout in `recv`: rank-major blocks; inside rank r's
 * block, that rank's pieces of the message's tensors in slot order. */
static gs_status_t gather_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_tensor_t *in,
                                  const gs_tensor_t *out, int64_t n, const int64_t *counts,
                                  int64_t *bcounts, int64_t *displs) {
  gs_comm_t c = e->comm;
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

static gs_status_t allgatherv_impl(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                          int64_t n, const int64_t *counts) {
  static const char fn[] = "gs_allgatherv";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  int p = c->size;
  gs_status_t local = gs_check_tensors(fn, "in", in, n);
  if (local == GS_SUCCESS) local = gs_check_tensors(fn, "out", out, n);
  if (local == GS_SUCCESS && n > 0 && !counts)
    local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts is NULL", fn);
  for (int64_t i = 0; local == GS_SUCCESS && i < n; i++) {
    int64_t sum = 0;
    for (int r = 0; r < p; r++) sum += counts[(size_t)r * n + i];
    if (out[i].dtype != in[i].dtype)
      local = gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                      gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
    else if (counts[(size_t)c->rank * n + i] != in[i].count)
      local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts says this rank has %lld elements "
                      "of tensor %lld, in[%lld] has %lld", fn,
                      (long long)counts[(size_t)c->rank * n + i], (long long)i, (long long)i,
                      (long long)in[i].count);
    else if (out[i].count != sum)
      local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: out[%lld] has %lld elements, the gathered "
                      "tensor has %lld", fn, (long long)i, (long long)out[i].count, (long long)sum);
  }
  if (local == GS_SUCCESS) local = gs_check_memory(c, fn, in, n, out, n);
  /* a device copy of in into out races where a host memmove did not */
  if (local == GS_SUCCESS && n > 0 && out[0].device.kind == GS_DEVICE_CUDA)
    local = gs_check_disjoint(fn, in, out, n);
  gs_call_t call = {GS_CALL_ALLGATHERV, GS_OP_SUM, 0, n, out, NULL, NULL, 0};
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;

  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, out, n, c));
  int64_t *scratch = malloc(2 * (size_t)p * sizeof *scratch);
  gs_status_t s = scratch ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  gs_engine_t e;
  if (s == GS_SUCCESS) s = gs_engine_open(c, out, n, &e);
  else e.device = -1;
  e.call = "allgather";
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++)
    if (plan.msgs[k].count > 0)
      s = gather_message(&e, &plan, &plan.msgs[k], in, out, n, counts, scratch, scratch + p);
  free(scratch);
  gs_plan_free(&plan);
  return gs_engine_close(&e, s);
}

gs_status_t gs_allgather_counts(gs_comm_t c, const gs_tensor_t *in, int64_t n, const int64_t *row_elems, int64_t *counts_out) {
  gs_enter_runtime();
  gs_status_t s = allgather_counts_impl(c, in, n, row_elems, counts_out);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_allgatherv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n, const int64_t *counts) {
  gs_enter_runtime();
  gs_status_t s = allgatherv_impl(c, in, out, n, counts);
  gs_leave_runtime();
  return s;
}
