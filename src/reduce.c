/* Fused reduce to a root: allreduce's plan and arithmetic (prescale as the
 * inputs are packed, postscale and average's 1/size as the root unpacks),
 * with the result at one rank. Inputs are read only, except the root's in an
 * in-place call. */
#include "gs_internal.h"

/* One message. The sending side is the inputs' own memory when it is laid
 * out as the message and needs no prescale, else the fusion buffer's first
 * part; the root receives into its outputs' memory when that is laid out as
 * the message, else into the buffer's second part. */
static gs_status_t reduce_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_tensor_t *in,
                                  const gs_tensor_t *dst, gs_op_t op, double pre, double post,
                                  int root) {
  gs_comm_t c = e->comm;
  int at_root = c->rank == root;
  size_t es = gs_dtype_size(m->dtype), bytes = (size_t)m->count * es;
  size_t half = (bytes + 63) & ~(size_t)63;
  void *ibase = NULL, *obase = NULL, *buf = NULL;
  int icontig = gs_plan_contiguous(plan, m, in, &ibase);
  int ocontig = at_root && gs_plan_contiguous(plan, m, dst, &obase);
  const void *send = ibase;
  void *recv = at_root && ocontig ? obase : NULL;
  /* MPI forbids aliased buffers except as MPI_IN_PLACE, which only the host
   * path passes: a device transport gets a packed copy instead */
  int packed = !icontig || pre != 1.0 || (send == recv && gs_engine_on_device(e));
  if (packed || (at_root && !ocontig)) GS_CHECK(gs_buffer_reserve(e, 2 * half, &buf));
  if (at_root && !ocontig) recv = (char *)buf + half;
  if (packed) {
    GS_CHECK(gs_pack(e, plan, m, in, buf, pre));
    send = buf;
  }
  GS_CHECK(gs_xfer_reduce(e, send, recv, m->count, m->dtype, op, root));
  if (!at_root) return GS_SUCCESS;
  if (ocontig) return gs_scale_copy(e, m->dtype, obase, obase, post == 1.0 ? 0 : m->count, post);
  return gs_unpack(e, plan, m, recv, dst, post);
}

static gs_status_t reduce_impl(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                               int64_t n, gs_op_t op, double prescale, double postscale,
                               int root) {
  static const char fn[] = "gs_reduce";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  int at_root = root >= 0 && root < c->size && c->rank == root;
  if (!at_root || out == in) out = NULL; /* read at the root only; in == out: in place */
  gs_status_t local = gs_check_tensors(fn, "in", in, n);
  if (local == GS_SUCCESS && (root < 0 || root >= c->size))
    local = gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of a communicator of "
                    "size %d", fn, root, c->size);
  if (local == GS_SUCCESS && out) local = gs_check_tensors(fn, "out", out, n);
  if (local == GS_SUCCESS && out) local = gs_check_outputs(fn, in, out, n);
  if (local == GS_SUCCESS) local = gs_check_op(fn, op, in, n, prescale, postscale, 0);
  if (local == GS_SUCCESS) local = gs_check_memory(c, fn, in, n, out, out ? n : 0);
  gs_call_t call = {GS_CALL_REDUCE, op, root, n, in, NULL, NULL, 0};
  if (local != GS_SUCCESS) call.n = 0, call.tensors = NULL; /* may be unreadable */
  GS_CHECK(gs_begin_call(c, &call, local));
  if (n == 0) return GS_SUCCESS;

  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, in, n, c));
  gs_engine_t e;
  gs_status_t s = gs_engine_open(c, in, n, &e);
  e.call = "reduce";
  double post = op == GS_OP_AVERAGE ? postscale * (1.0 / c->size) : postscale;
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++)
    if (plan.msgs[k].count > 0)
      s = reduce_message(&e, &plan, &plan.msgs[k], in, out ? out : in, op, prescale, post, root);
  gs_plan_free(&plan);
  return gs_engine_close(&e, s);
}

gs_status_t gs_reduce(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                      gs_op_t op, double prescale, double postscale, int root) {
  gs_enter_runtime();
  gs_status_t s = reduce_impl(c, in, out, n, op, prescale, postscale, root);
  gs_leave_runtime();
  return s;
}
