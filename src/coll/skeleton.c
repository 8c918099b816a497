/* The skeleton every public collective runs through. */
#include "coll/gs_collective.h"

double gs_postscale(gs_comm_t c, gs_op_t op, double postscale) {
  return op == GS_OP_AVERAGE ? postscale * (1.0 / c->size) : postscale;
}

/* The checks every collective shares, then its own; then where its memory
 * lives. A rank that fails them still takes part in validation. */
static gs_status_t check(gs_comm_t c, gs_coll_t *d) {
  if (d->own_checks) return d->check(c, d);
  gs_status_t s = gs_check_tensors(d->fn, d->in_name ? d->in_name : "in", d->in, d->n);
  if (s == GS_SUCCESS && (d->out || d->out_required))
    s = gs_check_tensors(d->fn, "out", d->out, d->n);
  if (s == GS_SUCCESS && d->op_checked)
    s = gs_check_op(d->fn, d->op, d->in, d->n, d->pre, d->post, d->allow_adasum);
  if (s == GS_SUCCESS && d->check) s = d->check(c, d);
  if (s == GS_SUCCESS && d->memory)
    s = gs_check_memory(c, d->fn, d->in, d->n, d->out, d->out ? d->n : 0);
  return s;
}

void gs_coll_counts_only(gs_coll_t *d, const int64_t *row_elems) {
  d->call.extra = row_elems;
  d->call.extra_name = "row size (elements per row)";
  d->call.counts_vary = 1;
  d->memory = NULL;
}

/* On a device every tensor is fused, whatever its size: a tensor alone
 * saves the host path a copy, but on the device the copy is a kernel at
 * memory bandwidth and each extra NCCL call a launch and a synchronisation
 * of the ranks (ResNet-50's list on an H200, 2 ranks sharing it: 85 NCCL
 * calls, 390 ms; fused, 2 calls, 5.9 ms; docs/GPU.md, issue 50). */
static gs_status_t messages(const gs_engine_t *e, gs_coll_t *d) {
  gs_plan_t plan;
  GS_CHECK(
      gs_plan_tensors(&plan, d->plan_on, d->n, e->comm, d->fuse_direct || gs_engine_on_device(e)));
  gs_status_t s = GS_SUCCESS;
  for (int64_t k = 0; k < plan.nmsgs && s == GS_SUCCESS; k++)
    if (plan.msgs[k].count > 0) s = d->message(e, &plan, &plan.msgs[k], d);
  gs_plan_free(&plan);
  return s;
}

uint64_t gs_coll_record(gs_comm_t c, int p2p, const char *name, const gs_tensor_t *t, int64_t n,
                        gs_op_t op, int root_or_peer, int tag) {
  gs_flight_call_t fc = {c->flight,    p2p, p2p ? ++c->p2p_seq : ++c->seq, name, t, n, (int32_t)op,
                         root_or_peer, tag};
  return gs_flight_enter(&fc);
}

/* Every collective passes here once, on every transport, checked or not. */
static uint64_t flight_begin(gs_comm_t c, const gs_coll_t *d) {
  return gs_coll_record(c, 0, d->record_as ? d->record_as : gs_call_name(d->kind), d->call.tensors,
                        d->call.n, d->op, d->root, 0);
}

static gs_status_t run(gs_comm_t c, gs_coll_t *d, uint64_t *fid) {
  GS_CHECK(gs_comm_enter(c, d->fn));
  gs_clear_error();
  d->comm = c;
  gs_call_options_t options;
  gs_get_call_options(&options); /* the caller's tag travels with the call */
  d->call = (gs_call_t){d->kind, d->op, d->root, d->n, d->in, NULL, NULL, 0, options.tag};
  d->plan_on = d->memory = d->in;
  gs_status_t local = check(c, d);
  if (local != GS_SUCCESS) { /* the tensors may be unreadable: validate the call alone */
    d->call.n = 0;
    d->call.tensors = NULL;
  }
  *fid = flight_begin(c, d);
  int taken = 0;
  if (local == GS_SUCCESS && d->shortcut) {
    gs_status_t s = d->shortcut(c, d, &taken);
    if (taken) {
      /* validated and reduced in one exchange: its phases end together */
      gs_flight_path(*fid, gs_flight_shortcut);
      return s;
    }
  }
  GS_CHECK(d->validate ? d->validate(c, d, local) : gs_begin_call(c, &d->call, local));
  gs_flight_phase(*fid, GS_FLIGHT_VALIDATED);
  if (d->n == 0) return GS_SUCCESS;
  d->post = gs_postscale(c, d->op, d->post);
  if (!d->memory) {
    gs_flight_path(*fid, "mpi");
    gs_flight_phase(*fid, GS_FLIGHT_SENT);
    return d->run(NULL, d);
  }
  gs_engine_t e;
  GS_CHECK(gs_engine_open(c, d->memory, d->n, &e));
  gs_flight_path(*fid, e.transport && e.transport->name ? e.transport->name : "host");
  gs_flight_phase(*fid, GS_FLIGHT_SENT);
  e.call = d->name;
  gs_status_t s = d->message ? messages(&e, d) : d->run(&e, d);
  return gs_engine_close(&e, s);
}

gs_status_t gs_collective(gs_comm_t c, gs_coll_t *d) {
  gs_enter_runtime();
  uint64_t fid = 0;
  gs_status_t s = run(c, d, &fid);
  gs_flight_end(fid, s);
  if (d->release) d->release(d);
  gs_leave_runtime();
  return s;
}
