/* Fused allreduce. */
#include <stdlib.h>

#include "coll/gs_collective.h"

/* Where reduce_message works: `in` is the input laid out as the message
 * (NULL: it is not), `at` the memory the message is reduced in (the
 * output's, the input's in place, or a window of the fusion buffer),
 * `window` whether `at` is that window: it holds one piece at a time,
 * packed into it and unpacked from it; `route` the path every piece takes. */
typedef struct reduce_at {
  const char *in;
  char *at;
  int window;
  const gs_route_t *route;
} reduce_at_t;

/* Message elements [first, first + count): into place, reduced, scaled or
 * unpacked. */
static gs_status_t reduce_range(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                const gs_coll_t *d, const reduce_at_t *r, int64_t first,
                                int64_t count) {
  size_t es = gs_dtype_size(m->dtype);
  char *at = r->window ? r->at : r->at + (size_t)first * es;
  const char *in = r->in ? r->in + (size_t)first * es : NULL;
  const gs_tensor_t *out = d->out ? d->out : d->in;
  if (in && in != at && d->pre == 1.0) {
    double t0 = GS_TL_START();
    GS_CHECK(r->route->run(e->comm, in, at, count, m->dtype, d->op));
    GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, count * (int64_t)es);
  } else {
    if (r->window || d->out || d->pre != 1.0)
      GS_CHECK(gs_pack_range(e, plan, m, d->in, at, d->pre, first, count));
    double t0 = GS_TL_START();
    GS_CHECK(r->route->run(e->comm, NULL, at, count, m->dtype, d->op));
    GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0, count * (int64_t)es);
  }
  if (r->window) return gs_unpack_range(e, plan, m, at, out, d->post, first, count);
  return gs_scale_copy(e, m->dtype, at, at, d->post == 1.0 ? 0 : count, d->post);
}

/* allreduce's state across its messages. */
typedef struct allreduce_state {
  int sum_levels;      /* hierarchical Adasum: levels inside a group only sum */
  int64_t done_through; /* messages up to this index went with an earlier one */
} allreduce_state_t;

/* The last message of the run that starts with m: the messages after it of
 * its dtype (the plan's grouping serves packing, and nothing is packed on
 * the segments path). */
static const gs_message_t *run_end(const gs_plan_t *plan, const gs_message_t *m) {
  const gs_message_t *last = m;
  while (last + 1 < plan->msgs + plan->nmsgs && last[1].dtype == m->dtype) last++;
  return last;
}

/* Message m's path, asked of the transport once (its route): the run's
 * segments where they lie, or the pieces and the allreduce each takes. A
 * transport without a route, and device memory, take the message whole. */
static gs_status_t route_message(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                 gs_route_t *r) {
  *r = (gs_route_t){.run = e->transport->allreduce};
  if (!e->transport->route || gs_engine_on_device(e)) return GS_SUCCESS;
  int64_t count = 0, nseg = 0;
  if (e->transport->allreduce_segments) {
    const gs_message_t *last = run_end(plan, m);
    for (const gs_message_t *k = m; k <= last; k++) count += k->count;
    nseg = last->first + last->nslots - m->first;
  }
  return e->transport->route(e->comm, m->dtype, m->count, count, nseg, r);
}

/* The run starting at m by the transport's allreduce_segments, as its route
 * said: every tensor where it is (inside one host the peers read it there,
 * transport/mpi/cma.c); *taken = 0 if it declines after all (a refused
 * probe), and then m goes by the route's pieces. */
static gs_status_t segments_message(const gs_engine_t *e, const gs_plan_t *plan,
                                    const gs_message_t *m, gs_coll_t *d, int *taken) {
  const gs_message_t *last = run_end(plan, m);
  int64_t nseg = last->first + last->nslots - m->first, count = 0;
  gs_seg_t *seg = malloc(2 * (size_t)nseg * sizeof *seg);
  if (!seg) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  gs_seg_t *in = seg, *out = seg + nseg;
  for (int64_t k = 0; k < nseg; k++) {
    const gs_slot_t *s = &plan->slots[m->first + k];
    in[k] = (gs_seg_t){d->in[s->tensor].data, s->count};
    out[k] = (gs_seg_t){(d->out ? d->out : d->in)[s->tensor].data, s->count};
    count += s->count;
  }
  double t0 = GS_TL_START();
  gs_status_t st = e->transport->allreduce_segments(e->comm, d->out ? in : NULL, out, nseg,
                                                    m->dtype, d->op, d->pre, d->post, taken);
  if (*taken) {
    ((allreduce_state_t *)d->extra)->done_through = last - plan->msgs;
    gs_count_message(e->comm, count, m->dtype);
    GS_TL_END("communicate", e->call, 1 + (m - plan->msgs), t0,
              count * (int64_t)gs_dtype_size(m->dtype));
  }
  free(seg);
  return st;
}

/* One message, reduced where the memory already lies like the message, or
 * in a window of the fusion buffer. Large host messages go in pieces of the
 * communicator's pipeline size, each packed, reduced and scaled or unpacked
 * before the next: a piece stays in cache across those passes, where the
 * whole message would go through memory three times.
 * Out of place, host messages go through the window too (issue 34): the
 * output is usually a new array per call, and MPI over UCX with its
 * registration cache on keeps memory for every new buffer it moves data
 * through; the fusion buffer is the same memory on every call. In place,
 * the caller's buffer goes to MPI as before (gradients live across steps,
 * and two more copies would slow the common path). The pieces and so MPI's
 * calls are the same either way, and so are the results, bit for bit. */
static gs_status_t reduce_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, gs_coll_t *d) {
  if (m - plan->msgs <= ((allreduce_state_t *)d->extra)->done_through) return GS_SUCCESS;
  gs_route_t route;
  GS_CHECK(route_message(e, plan, m, &route));
  if (route.segments) {
    int taken = 0;
    GS_CHECK(segments_message(e, plan, m, d, &taken));
    if (taken) return GS_SUCCESS;
  }
  void *ibase = NULL, *obase = NULL;
  int icontig = gs_plan_contiguous(plan, m, d->in, &ibase);
  int ocontig = d->out ? gs_plan_contiguous(plan, m, d->out, &obase) : icontig;
  if (!d->out) obase = ibase;
  /* messages of no elements never get here */
  int64_t piece = route.piece > 0 ? route.piece : m->count;
  reduce_at_t r = {icontig ? ibase : NULL, obase, !ocontig, &route};
  if (!gs_engine_on_device(e) && d->out) r = (reduce_at_t){NULL, NULL, 1, &route};
  if (r.window) {
    void *buf = NULL;
    GS_CHECK(gs_buffer_reserve(e, (size_t)piece * gs_dtype_size(m->dtype), &buf));
    r.at = buf;
  }
  gs_count_message(e->comm, m->count, m->dtype);
  for (int64_t first = 0; first < m->count; first += piece)
    GS_CHECK(reduce_range(e, plan, m, d, &r, first,
                          m->count - first < piece ? m->count - first : piece));
  return GS_SUCCESS;
}

/* Adasum of one message: it needs the message contiguous, so it runs in the
 * tensors' memory when they are back to back and in the fusion buffer
 * otherwise. */
static gs_status_t adasum_message(const gs_engine_t *e, const gs_plan_t *plan,
                                  const gs_message_t *m, const gs_tensor_t *in,
                                  const gs_tensor_t *out, double pre, double post, int sum_levels) {
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
  if (in_place_memory) return gs_scale_copy(e, m->dtype, x, x, post == 1.0 ? 0 : m->count, post);
  return gs_unpack(e, plan, m, x, out ? out : in, post);
}

/* Whether a call is small enough to travel inside the validation message.
 * Depends only on what the ranks validate (count, dtypes, sizes, op,
 * threshold), so ranks that agree on the call also agree on this. */
static int rides_in_check(const gs_tensor_t *t, int64_t n, gs_op_t op, gs_comm_t c) {
  if (n < 1 || gs_op_is_adasum(op) || t[0].device.kind == GS_DEVICE_CUDA) return 0;
  int64_t bytes = 0, payload = gs_check_payload_limit(c);
  int64_t limit = c->fusion_threshold < payload ? c->fusion_threshold : payload;
  for (int64_t i = 0; i < n; i++) {
    int64_t b = t[i].count * (int64_t)gs_dtype_size(t[i].dtype);
    if (t[i].dtype != t[0].dtype) return 0; /* one message only */
    /* through MPI a tensor of direct_bytes goes alone (not packed): then the
     * call is several messages; the shared slot packs every tensor */
    if (!c->shm && b >= c->direct_bytes) return 0;
    bytes += b;
    if (bytes > limit) return 0;
  }
  return 1;
}

/* Validates and reduces in one collective when the call rides. Over the
 * host's shared region the tensors are packed straight into this rank's
 * slot and the ranks' slots folded straight into the outputs: the data is
 * copied once each way, as a fused message through MPI is twice. */
static gs_status_t small_allreduce(gs_comm_t c, gs_coll_t *d, int *taken) {
  const gs_call_t *call = &d->call;
  const gs_tensor_t *in = d->in, *out = d->out;
  gs_op_t op = d->op;
  double pre = d->pre, postscale = d->post;
  if (!c->check || !rides_in_check(in, d->n, op, c)) return GS_SUCCESS;
  *taken = 1;
  c->stats.calls++;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG, "allreduce: %lld tensors, op %s, inside the validation message",
           (long long)call->n, gs_op_name(op));
  gs_plan_t plan;
  GS_CHECK(gs_plan_tensors(&plan, in, call->n, c, c->shm != NULL));
  const gs_message_t *m = &plan.msgs[0];
  uint64_t staging[GS_CHECK_PAYLOAD_BYTES / 8];
  void *area = gs_check_payload_area(c);
  gs_engine_t host = {
      .comm = c, .call = "allreduce", .device = -1, .stream = NULL, .transport = &gs_mpi_transport};
  gs_pack(&host, &plan, m, in, area ? area : staging, pre);
  gs_payload_t payload = {area ? area : staging, m->count, m->dtype, op, NULL};
  double t0 = GS_TL_START();
  gs_status_t s = gs_check_call(c, call, GS_SUCCESS, &payload);
  double post = gs_postscale(c, op, postscale);
  if (s == GS_SUCCESS && payload.peers)
    gs_unpack_fold(&plan, m, payload.peers, GS_CHECK_SLOT_PAYLOAD, c->size, op, out ? out : in,
                   post);
  else if (s == GS_SUCCESS) gs_unpack(&host, &plan, m, staging, out ? out : in, post);
  GS_TL_END("validate + reduce", "allreduce", 0, t0, m->count * (int64_t)gs_dtype_size(m->dtype));
  gs_plan_free(&plan);
  return s;
}

/* Per message: Adasum, or a reduction. */
static gs_status_t allreduce_message(const gs_engine_t *e, const gs_plan_t *plan,
                                     const gs_message_t *m, gs_coll_t *d) {
  const allreduce_state_t *state = d->extra;
  if (gs_op_is_adasum(d->op))
    return adasum_message(e, plan, m, d->in, d->out, d->pre, d->post, state->sum_levels);
  return reduce_message(e, plan, m, d);
}

/* Outputs like the inputs; hierarchical Adasum's group. */
static gs_status_t allreduce_check(gs_comm_t c, gs_coll_t *d) {
  if (d->out) GS_CHECK(gs_check_outputs(d->fn, d->in, d->out, d->n));
  if (d->op != GS_OP_ADASUM_HIERARCHICAL) return GS_SUCCESS;
  int group = 1;
  allreduce_state_t *state = d->extra;
  GS_CHECK(gs_adasum_group_size(c, d->fn, &group));
  while ((1 << state->sum_levels) < group) state->sum_levels++;
  return GS_SUCCESS;
}

gs_status_t gs_allreduce(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                         gs_op_t op, double prescale, double postscale) {
  allreduce_state_t state = {0, -1};
  gs_coll_t d = {.fn = "gs_allreduce",
                 .kind = GS_CALL_ALLREDUCE,
                 .in = in,
                 .out = out == in ? NULL : out,
                 .n = n,
                 .op = op,
                 .pre = prescale,
                 .post = postscale,
                 .extra = &state,
                 .check = allreduce_check,
                 .op_checked = 1,
                 .allow_adasum = 1,
                 .shortcut = small_allreduce,
                 .message = allreduce_message};
  d.name = gs_op_is_adasum(op) ? "allreduce adasum" : "allreduce";
  return gs_collective(c, &d);
}
