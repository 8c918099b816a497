/* Fused broadcast. */
#include "gs_internal.h"

static gs_status_t broadcast_impl(gs_comm_t c, const gs_tensor_t *t, int64_t n, int root) {
  static const char fn[] = "gs_broadcast";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  gs_status_t local = gs_check_tensors(fn, "tensors", t, n);
  if (local == GS_SUCCESS && (root < 0 || root >= c->size))
    local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of a communicator of size %d",
                    fn, root, c->size);
  if (local == GS_SUCCESS) local = gs_check_memory(c, fn, t, n, NULL, 0);
  gs_call_t call = {GS_CALL_BROADCAST, GS_OP_SUM, root, n, t, NULL, NULL, 0};
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;

  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, t, n, c));
  gs_engine_t e;
  gs_status_t s = gs_engine_open(c, t, n, &e);
  e.call = "broadcast";
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++) {
    const gs_message_t *m = &plan.msgs[k];
    if (m->count == 0) continue;
    void *base = NULL;
    double t0;
    int64_t row = 1 + k, bytes = m->count * (int64_t)gs_dtype_size(m->dtype);
    if (gs_plan_contiguous(&plan, m, t, &base)) {
      t0 = GS_TL_START();
      s = e.transport->broadcast(c, base, m->count, m->dtype, root);
      GS_TL_END("communicate", e.call, row, t0, bytes);
      continue;
    }
    s = gs_buffer_reserve(&e, (size_t)m->count * gs_dtype_size(m->dtype), &base);
    if (s == GS_SUCCESS && c->rank == root) s = gs_pack(&e, &plan, m, t, base, 1.0);
    t0 = GS_TL_START();
    if (s == GS_SUCCESS) s = e.transport->broadcast(c, base, m->count, m->dtype, root);
    GS_TL_END("communicate", e.call, row, t0, bytes);
    if (s == GS_SUCCESS && c->rank != root) s = gs_unpack(&e, &plan, m, base, t, 1.0);
  }
  gs_plan_free(&plan);
  return gs_engine_close(&e, s);
}

gs_status_t gs_broadcast(gs_comm_t c, const gs_tensor_t *t, int64_t n, int root) {
  gs_enter_runtime();
  gs_status_t s = broadcast_impl(c, t, n, root);
  gs_leave_runtime();
  return s;
}
