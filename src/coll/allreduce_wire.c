/* Allreduce in a low-precision wire format: the call's checks, and per
 * message the float32 work buffer around the transport's wire path (its
 * route's: transport/mpi/wire.c flat, hier_wire.c across hosts). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll/gs_collective.h"

typedef struct wire_call {
  gs_wire_t wire;
  const gs_tensor_t *residual; /* NULL: no error feedback */
  int64_t *tags;               /* the wire per tensor, which the ranks validate */
} wire_call_t;

static int wire_takes(gs_wire_t wire, gs_dtype_t dtype) {
  int fp8 = wire == GS_WIRE_FLOAT8_E4M3 || wire == GS_WIRE_FLOAT8_E5M2;
  return dtype == GS_FLOAT32 || (fp8 && (dtype == GS_FLOAT16 || dtype == GS_BFLOAT16));
}

static int same_memory(gs_device_t a, gs_device_t b) {
  int cuda_a = a.kind == GS_DEVICE_CUDA, cuda_b = b.kind == GS_DEVICE_CUDA;
  return cuda_a == cuda_b && (!cuda_a || a.id == b.id);
}

static const char *memory_name(gs_device_t d, char name[32]) {
  if (d.kind != GS_DEVICE_CUDA) return "host memory";
  snprintf(name, 32, "CUDA device %d", d.id);
  return name;
}

static gs_status_t check_residual(const gs_coll_t *d, const gs_tensor_t *res) {
  GS_CHECK(gs_check_tensors(d->fn, "residual", res, d->n));
  char a[32], b[32];
  for (int64_t i = 0; i < d->n; i++) {
    if (res[i].dtype != GS_FLOAT32 || res[i].count != d->in[i].count ||
        !same_memory(res[i].device, d->in[i].device))
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: residual[%lld] must be float32 of in[%lld]'s count (%lld) in the same "
                     "memory (%s); it is %s, %lld elements, in %s",
                     d->fn, (long long)i, (long long)i, (long long)d->in[i].count,
                     memory_name(d->in[i].device, a), gs_dtype_name(res[i].dtype),
                     (long long)res[i].count, memory_name(res[i].device, b));
  }
  return gs_check_disjoint(d->fn, d->in, res, d->n);
}

static gs_status_t wire_check(gs_comm_t c, gs_coll_t *d) {
  (void)c;
  wire_call_t *w = d->extra;
  if (d->out) GS_CHECK(gs_check_outputs(d->fn, d->in, d->out, d->n));
  if ((unsigned)w->wire >= GS_NUM_WIRES || w->wire == GS_WIRE_NONE)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: wire %d is not a wire format (bfloat16, float16, float8_e4m3, "
                   "float8_e5m2)",
                   d->fn, (int)w->wire);
  if (d->op != GS_OP_SUM && d->op != GS_OP_AVERAGE)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: op %s does not take wire %s; a wire format sums (op sum or average)", d->fn,
                   gs_op_name(d->op), gs_wire_name(w->wire));
  for (int64_t i = 0; i < d->n; i++) {
    if (!wire_takes(w->wire, d->in[i].dtype))
      return gs_fail(GS_ERR_TYPE,
                     "%s: in[%lld] is %s, which wire %s does not take (float32 tensors; "
                     "float16/bfloat16 ones with a float8 wire)",
                     d->fn, (long long)i, gs_dtype_name(d->in[i].dtype), gs_wire_name(w->wire));
  }
  if (w->residual) GS_CHECK(check_residual(d, w->residual));
  w->tags = malloc((size_t)(d->n > 0 ? d->n : 1) * sizeof *w->tags);
  if (!w->tags) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  for (int64_t i = 0; i < d->n; i++) w->tags[i] = w->wire;
  d->call.extra = w->tags;
  d->call.extra_name = "wire format";
  return GS_SUCCESS;
}

static void wire_release(gs_coll_t *d) {
  wire_call_t *w = d->extra;
  free(w->tags);
  w->tags = NULL;
}

/* One message on the host: its float32 work (the output itself when it is
 * float32 and lies like the message; else scratch), filled and emptied
 * segment by segment from inside the transport's pipeline (the hooks), so
 * packing and unpacking overlap the other segments' transfers and each
 * segment is touched while in cache. */
typedef struct wire_msg {
  const gs_engine_t *e;
  const gs_plan_t *plan;
  const gs_message_t *m;
  const gs_coll_t *d;
  const gs_tensor_t *out, *residual;
  const char *ibase; /* the input, when it lies like the message */
  char *obase;       /* the output, likewise */
  char *buf;         /* float16/bfloat16 messages: the packed input or output */
  float *work, *lost;
  int in_out;        /* work is the output */
} wire_msg_t;

/* Message elements [first, first + n) of the residuals added to work
 * (add) or set from lost. */
static void residual_range(const wire_msg_t *w, int64_t first, int64_t n, int add) {
  int64_t end = first + n;
  for (int64_t k = w->m->first; k < w->m->first + w->m->nslots; k++) {
    const gs_slot_t *s = &w->plan->slots[k];
    int64_t lo = s->offset > first ? s->offset : first;
    int64_t hi = s->offset + s->count < end ? s->offset + s->count : end;
    if (lo >= hi) continue;
    float *r = (float *)w->residual[s->tensor].data + (lo - s->offset);
    if (add)
      for (int64_t i = 0; i < hi - lo; i++) w->work[lo + i] += r[i];
    else memcpy(r, w->lost + lo, (size_t)(hi - lo) * sizeof(float));
  }
}

/* The input's elements [first, first + n) into work, times the prescale,
 * plus the residual. */
static gs_status_t wire_prepare(void *ctx, int64_t first, int64_t n) {
  wire_msg_t *w = ctx;
  gs_dtype_t dt = w->m->dtype;
  size_t es = gs_dtype_size(dt);
  float *dst = w->work + first;
  if (w->ibase) {
    const char *src = w->ibase + (size_t)first * es;
    if ((const void *)src != (const void *)dst || w->d->pre != 1.0)
      gs_wire_widen(dt, src, dst, n, w->d->pre);
  } else if (dt == GS_FLOAT32) {
    GS_CHECK(gs_pack_range(w->e, w->plan, w->m, w->d->in, dst, w->d->pre, first, n));
  } else {
    char *b = w->buf + (size_t)first * es;
    GS_CHECK(gs_pack_range(w->e, w->plan, w->m, w->d->in, b, 1.0, first, n));
    gs_wire_widen(dt, b, dst, n, w->d->pre);
  }
  if (w->lost) {
    memset(w->lost + first, 0, (size_t)n * sizeof(float));
    residual_range(w, first, n, 1);
  }
  return GS_SUCCESS;
}

/* Elements [first, first + n) are final: the residuals, then the output. */
static gs_status_t wire_finish(void *ctx, int64_t first, int64_t n) {
  wire_msg_t *w = ctx;
  gs_dtype_t dt = w->m->dtype;
  size_t es = gs_dtype_size(dt);
  if (w->lost) residual_range(w, first, n, 0);
  if (w->in_out) return GS_SUCCESS;
  if (w->obase) {
    gs_wire_narrow(dt, w->work + first, w->obase + (size_t)first * es, n);
    return GS_SUCCESS;
  }
  const void *src = w->work + first;
  if (dt != GS_FLOAT32) {
    gs_wire_narrow(dt, w->work + first, w->buf + (size_t)first * es, n);
    src = w->buf + (size_t)first * es;
  }
  return gs_unpack_range(w->e, w->plan, w->m, src, w->out, 1.0, first, n);
}

/* One message: on a device, the device path; on the host, the work buffer
 * around the transport's pipeline. */
static gs_status_t wire_message(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                gs_coll_t *d) {
  wire_call_t *wc = d->extra;
  const gs_tensor_t *out = d->out ? d->out : d->in;
  double t0 = GS_TL_START();
  if (gs_engine_on_device(e)) {
    GS_CHECK(
        gs_wire_device_message(e, plan, m, d->in, out, wc->residual, wc->wire, d->pre, d->post));
    GS_TL_END("communicate (wire)", e->call, 1 + (m - plan->msgs), t0, m->count * 4);
    return GS_SUCCESS;
  }
  wire_msg_t w = {.e = e, .plan = plan, .m = m, .d = d, .out = out, .residual = wc->residual};
  void *ibase = NULL, *obase = NULL;
  if (gs_plan_contiguous(plan, m, d->in, &ibase)) w.ibase = ibase;
  if (gs_plan_contiguous(plan, m, out, &obase)) w.obase = obase;
  size_t n = (size_t)m->count;
  int half = m->dtype != GS_FLOAT32;
  if (half && (!w.ibase || !w.obase))
    GS_CHECK(gs_buffer_reserve(e, n * gs_dtype_size(m->dtype), (void **)&w.buf));
  /* float32 output lying like the message: the work happens there (no
   * copy in, no copy out) */
  w.in_out = w.obase && !half;
  size_t slots = (w.in_out ? 0 : 1) + (wc->residual ? 1 : 0);
  float *scratch = NULL;
  if (slots) GS_CHECK(gs_scratch_reserve(e, n * sizeof(float) * slots, (void **)&scratch));
  w.work = w.in_out ? (float *)w.obase : scratch;
  if (wc->residual) w.lost = w.in_out ? scratch : scratch + n;
  gs_wire_hooks_t hooks = {.prepare = wire_prepare, .finish = wire_finish, .ctx = &w};
  /* the path, asked of the transport once (its route: float32 work) */
  gs_route_t route = {0};
  if (e->transport->route)
    GS_CHECK(e->transport->route(e->comm, GS_FLOAT32, m->count, 0, 0, &route));
  if (!route.wire)
    return gs_fail(GS_ERR_UNSUPPORTED, "%s: transport %s has no wire path", d->fn,
                   e->transport->name);
  /* where nothing needs converting, a path that reads the message where it
   * lies does so (no packing, no unpacking) */
  gs_seg_t *seg = NULL;
  if (route.wire_segments && !half && d->pre == 1.0 && !wc->residual) {
    seg = malloc(2 * (size_t)m->nslots * sizeof *seg);
    if (!seg) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
    for (int64_t k = 0; k < m->nslots; k++) {
      const gs_slot_t *sl = &plan->slots[m->first + k];
      seg[k] = (gs_seg_t){d->in[sl->tensor].data, sl->count};
      seg[m->nslots + k] = (gs_seg_t){out[sl->tensor].data, sl->count};
    }
    hooks.in = d->out ? seg : NULL;
    hooks.out = seg + m->nslots;
    hooks.nseg = m->nslots;
  }
  gs_status_t st = route.wire(e->comm, w.work, m->count, wc->wire, d->post, w.lost, &hooks);
  free(seg);
  GS_TL_END("communicate (wire)", e->call, 1 + (m - plan->msgs), t0, m->count * 4);
  return st;
}

gs_status_t gs_allreduce_wire(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                              gs_op_t op, double prescale, double postscale, gs_wire_t wire,
                              const gs_tensor_t *residual) {
  if (wire == GS_WIRE_NONE && !residual)
    return gs_allreduce(c, in, out, n, op, prescale, postscale);
  wire_call_t w = {.wire = wire, .residual = residual};
  gs_coll_t d = {.fn = "gs_allreduce_wire",
                 .name = "allreduce (wire)",
                 .kind = GS_CALL_ALLREDUCE,
                 .in = in,
                 .out = out == in ? NULL : out,
                 .n = n,
                 .op = op,
                 .pre = prescale,
                 .post = postscale,
                 .extra = &w,
                 .check = wire_check,
                 .op_checked = 1,
                 .allow_adasum = 1, /* refused by wire_check, naming the wire */
                 .message = wire_message,
                 .fuse_direct = 1, /* the passes read the tensors where they lie */
                 .release = wire_release};
  return gs_collective(c, &d);
}
