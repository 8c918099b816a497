/* Fused allreduce. */
#include <stdlib.h>

#include "gs_internal.h"

/* Plans a list for a call: counts and dtypes straight from the tensors. */
gs_status_t gs_plan_tensors(gs_plan_t *plan, const gs_tensor_t *t, int64_t n,
                            gs_comm_t comm) {
  int64_t counts_small[GS_PLAN_INLINE];
  gs_dtype_t dtypes_small[GS_PLAN_INLINE];
  int small = n <= GS_PLAN_INLINE;
  int64_t *counts = small ? counts_small : malloc((size_t)n * sizeof *counts);
  gs_dtype_t *dtypes = small ? dtypes_small : malloc((size_t)n * sizeof *dtypes);
  gs_status_t s = GS_SUCCESS;
  if (!counts || !dtypes) s = gs_fail(GS_ERR_NO_MEMORY, "fusion plan: out of memory");
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++) {
    counts[i] = t[i].count;
    dtypes[i] = t[i].dtype;
  }
  if (s == GS_SUCCESS)
    s = gs_plan_build(plan, counts, dtypes, n, comm->fusion_threshold, comm->direct_bytes);
  if (!small) {
    free(counts);
    free(dtypes);
  }
  return s;
}

/* One message. Memory that is already laid out like the message is reduced
 * where it is; otherwise the message goes through the fusion buffer. */
static gs_status_t reduce_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_tensor_t *in,
                                  const gs_tensor_t *out, gs_op_t op, double pre, double post) {
  gs_comm_t c = e->comm;
  const gs_transport_t *tr = e->transport;
  void *ibase = NULL, *obase = NULL, *buf = NULL;
  int icontig = gs_plan_contiguous(plan, m, in, &ibase);
  int ocontig = out ? gs_plan_contiguous(plan, m, out, &obase) : icontig;
  if (!out) obase = ibase;

  int64_t row = 1 + (m - plan->msgs), bytes = m->count * (int64_t)gs_dtype_size(m->dtype);
  double t0;
  if (ocontig) {
    if (out && icontig && pre == 1.0 && ibase != obase) {
      t0 = GS_TL_START();
      GS_CHECK(tr->allreduce(c, ibase, obase, m->count, m->dtype, op));
    } else {
      if (out || pre != 1.0) GS_CHECK(gs_pack(e, plan, m, in, obase, pre)); /* into place */
      t0 = GS_TL_START();
      GS_CHECK(tr->allreduce(c, NULL, obase, m->count, m->dtype, op));
    }
    GS_TL_END("communicate", e->call, row, t0, bytes);
    return gs_scale_copy(e, m->dtype, obase, obase, post == 1.0 ? 0 : m->count, post);
  }
  GS_CHECK(gs_buffer_reserve(e, (size_t)m->count * gs_dtype_size(m->dtype), &buf));
  if (icontig && pre == 1.0) {
    t0 = GS_TL_START();
    GS_CHECK(tr->allreduce(c, ibase, buf, m->count, m->dtype, op));
  } else {
    GS_CHECK(gs_pack(e, plan, m, in, buf, pre));
    t0 = GS_TL_START();
    GS_CHECK(tr->allreduce(c, NULL, buf, m->count, m->dtype, op));
  }
  GS_TL_END("communicate", e->call, row, t0, bytes);
  return gs_unpack(e, plan, m, buf, out ? out : in, post);
}

/* Adasum of one message: it needs the message contiguous, so it runs in the
 * tensors' memory when they are back to back and in the fusion buffer
 * otherwise. */
static gs_status_t adasum_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_tensor_t *in,
                                  const gs_tensor_t *out, double pre, double post,
                                  int sum_levels) {
  void *ibase = NULL, *obase = NULL, *x = NULL;
  int icontig = gs_plan_contiguous(plan, m, in, &ibase);
  int ocontig = out ? gs_plan_contiguous(plan, m, out, &obase) : 0;
  int in_place_memory = 1;
  if (!out && icontig) {
    x = ibase;
    GS_CHECK(gs_scale_copy(e, m->dtype, x, x, pre == 1.0 ? 0 : m->count, pre));
  } else if (out && ocontig) {
    x = obase;
    GS_CHECK(gs_pack(e, plan, m, in, x, pre));
  } else {
    GS_CHECK(gs_buffer_reserve(e, (size_t)m->count * gs_dtype_size(m->dtype), &x));
    GS_CHECK(gs_pack(e, plan, m, in, x, pre));
    in_place_memory = 0;
  }
  GS_CHECK(gs_adasum_message(e, plan, m, x, sum_levels));
  if (in_place_memory)
    return gs_scale_copy(e, m->dtype, x, x, post == 1.0 ? 0 : m->count, post);
  return gs_unpack(e, plan, m, x, out ? out : in, post);
}

/* Whether a call is small enough to travel inside the validation message.
 * Depends only on what the ranks validate (count, dtypes, sizes, op,
 * threshold), so ranks that agree on the call also agree on this. */
static int rides_in_check(const gs_tensor_t *t, int64_t n, gs_op_t op, gs_comm_t c) {
  if (n < 1 || gs_op_is_adasum(op) || t[0].device.kind == GS_DEVICE_CUDA) return 0;
  int64_t bytes = 0;
  int64_t limit = c->fusion_threshold < GS_CHECK_PAYLOAD_BYTES ? c->fusion_threshold
                                                               : GS_CHECK_PAYLOAD_BYTES;
  for (int64_t i = 0; i < n; i++) {
    int64_t b = t[i].count * (int64_t)gs_dtype_size(t[i].dtype);
    if (t[i].dtype != t[0].dtype || b >= c->direct_bytes) return 0; /* one message only */
    bytes += b;
    if (bytes > limit) return 0;
  }
  return 1;
}

/* Validates and reduces in one collective; the call is known to ride. */
static gs_status_t small_allreduce(gs_comm_t c, const gs_call_t *call, const gs_tensor_t *in,
                                   const gs_tensor_t *out, gs_op_t op, double pre,
                                   double postscale) {
  c->stats.calls++;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG, "allreduce: %lld tensors, op %s, inside the validation message",
           (long long)call->n, gs_op_name(op));
  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, in, call->n, c));
  const gs_message_t *m = &plan.msgs[0];
  uint64_t staging[GS_CHECK_PAYLOAD_BYTES / 8];
  gs_engine_t host = {.comm = c, .call = "allreduce", .device = -1,
                      .stream = NULL, .transport = &gs_mpi_transport};
  gs_pack(&host, &plan, m, in, staging, pre);
  gs_payload_t payload = {staging, m->count, m->dtype, op};
  double t0 = GS_TL_START();
  gs_status_t s = gs_check_call(c, call, GS_SUCCESS, &payload);
  GS_TL_END("validate + reduce", "allreduce", 0, t0, m->count * (int64_t)gs_dtype_size(m->dtype));
  if (s == GS_SUCCESS) {
    double post = op == GS_OP_AVERAGE ? postscale * (1.0 / c->size) : postscale;
    gs_unpack(&host, &plan, m, staging, out ? out : in, post);
  }
  gs_plan_free(&plan);
  return s;
}

static gs_status_t allreduce_impl(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                         int64_t n, gs_op_t op, double prescale, double postscale) {
  static const char fn[] = "gs_allreduce";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  if (out == in) out = NULL;
  gs_status_t local = gs_check_tensors(fn, "in", in, n);
  if (local == GS_SUCCESS && out) local = gs_check_tensors(fn, "out", out, n);
  if (local == GS_SUCCESS && out) local = gs_check_outputs(fn, in, out, n);
  if (local == GS_SUCCESS) local = gs_check_op(fn, op, in, n, prescale, postscale, 1);
  if (local == GS_SUCCESS) local = gs_check_memory(c, fn, in, n, out, out ? n : 0);
  int group = 1, sum_levels = 0; /* hierarchical: levels inside a group only sum */
  if (local == GS_SUCCESS && op == GS_OP_ADASUM_HIERARCHICAL)
    local = gs_adasum_group_size(c, fn, &group);
  while ((1 << sum_levels) < group) sum_levels++;
  gs_call_t call = {GS_CALL_ALLREDUCE, op, 0, n, in, NULL, NULL, 0};
  if (c->check && local == GS_SUCCESS && rides_in_check(in, n, op, c))
    return small_allreduce(c, &call, in, out, op, prescale, postscale);
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;

  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, in, n, c));
  gs_engine_t e;
  gs_status_t s = gs_engine_open(c, in, n, &e);
  e.call = gs_op_is_adasum(op) ? "allreduce adasum" : "allreduce";
  double post = op == GS_OP_AVERAGE ? postscale * (1.0 / c->size) : postscale;
  if (gs_op_is_adasum(op)) post = postscale; /* hierarchical: averaged inside the tree */
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++)
    if (plan.msgs[k].count > 0)
      s = gs_op_is_adasum(op)
              ? adasum_message(&e, &plan, &plan.msgs[k], in, out, prescale, post, sum_levels)
              : reduce_message(&e, &plan, &plan.msgs[k], in, out, op, prescale, post);
  gs_plan_free(&plan);
  return gs_engine_close(&e, s);
}

gs_status_t gs_allreduce(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n, gs_op_t op, double prescale, double postscale) {
  gs_enter_runtime();
  gs_status_t s = allreduce_impl(c, in, out, n, op, prescale, postscale);
  gs_leave_runtime();
  return s;
}
