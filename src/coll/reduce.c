/* Fused reduce to a root: allreduce's plan and arithmetic (prescale as the
 * inputs are packed, postscale and average's 1/size as the root unpacks),
 * with the result at one rank. Inputs are read only, except the root's in an
 * in-place call. */
#include "coll/gs_collective.h"

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

static gs_status_t reduce_check(gs_comm_t c, gs_coll_t *d) {
  if (d->root < 0 || d->root >= c->size)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: root %d is not a rank of a communicator of "
                   "size %d",
                   d->fn, d->root, c->size);
  return d->out ? gs_check_outputs(d->fn, d->in, d->out, d->n) : GS_SUCCESS;
}

static gs_status_t reduce_one(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                              gs_coll_t *d) {
  return reduce_message(e, plan, m, d->in, d->out ? d->out : d->in, d->op, d->pre, d->post,
                        d->root);
}

gs_status_t gs_reduce(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                      gs_op_t op, double prescale, double postscale, int root) {
  int at_root = c && root >= 0 && gs_comm_valid(c, "gs_reduce") == GS_SUCCESS && root < c->size &&
                c->rank == root;
  gs_coll_t d = {.fn = "gs_reduce",
                 .name = "reduce",
                 .kind = GS_CALL_REDUCE,
                 .in = in,
                 .out = !at_root || out == in ? NULL : out, /* read at the root only */
                 .n = n,
                 .op = op,
                 .pre = prescale,
                 .post = postscale,
                 .root = root,
                 .op_checked = 1,
                 .check = reduce_check,
                 .message = reduce_one};
  return gs_collective(c, &d);
}
