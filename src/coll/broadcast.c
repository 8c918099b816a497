/* Fused broadcast. */
#include "coll/gs_collective.h"

static gs_status_t broadcast_check(gs_comm_t c, gs_coll_t *d) {
  if (d->root < 0 || d->root >= c->size)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: root %d is not a rank of a communicator of "
                   "size %d",
                   d->fn, d->root, c->size);
  return GS_SUCCESS;
}

/* One message: sent from the tensors' memory when it is laid out as the
 * message, else packed at the root and unpacked elsewhere. */
static gs_status_t broadcast_message(const gs_engine_t *e, const gs_plan_t *plan,
                                     const gs_message_t *m, gs_coll_t *d) {
  gs_comm_t c = e->comm;
  const gs_tensor_t *t = d->in;
  void *base = NULL;
  int root = d->root, contiguous = gs_plan_contiguous(plan, m, t, &base);
  int64_t row = 1 + (m - plan->msgs), bytes = m->count * (int64_t)gs_dtype_size(m->dtype);
  if (!contiguous) {
    GS_CHECK(gs_buffer_reserve(e, (size_t)bytes, &base));
    if (c->rank == root) GS_CHECK(gs_pack(e, plan, m, t, base, 1.0));
  }
  double t0 = GS_TL_START();
  GS_CHECK(e->transport->broadcast(c, base, m->count, m->dtype, root));
  GS_TL_END("communicate", e->call, row, t0, bytes);
  if (contiguous || c->rank == root) return GS_SUCCESS;
  return gs_unpack(e, plan, m, base, t, 1.0);
}

gs_status_t gs_broadcast(gs_comm_t c, const gs_tensor_t *t, int64_t n, int root) {
  gs_coll_t d = {.fn = "gs_broadcast",
                 .name = "broadcast",
                 .kind = GS_CALL_BROADCAST,
                 .in = t,
                 .in_name = "tensors",
                 .n = n,
                 .op = GS_OP_SUM,
                 .root = root,
                 .check = broadcast_check,
                 .message = broadcast_message};
  return gs_collective(c, &d);
}
