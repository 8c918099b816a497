/* Allreduce in a low-precision wire format: the call's checks, and per
 * message the float32 work buffer around transport/wire.c's exchange. */
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
    /* a tensor of no elements carries only its dtype, which the ranks
     * validate (the Horovod drop-in's name signatures) */
    if (d->in[i].count > 0 && !wire_takes(w->wire, d->in[i].dtype))
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

/* Message m's residuals to or from buf (float32, laid out as the message). */
static void residual_slots(const gs_plan_t *plan, const gs_message_t *m, const gs_tensor_t *res,
                           float *buf, int add) {
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    const gs_slot_t *s = &plan->slots[k];
    float *r = res[s->tensor].data, *b = buf + s->offset;
    if (add)
      for (int64_t i = 0; i < s->count; i++) b[i] += r[i];
    else if (s->count > 0) memcpy(r, b, (size_t)s->count * sizeof(float));
  }
}

/* One message: its input (in place or packed) widened to float32 with the
 * prescale, plus the residual; the wire allreduce; narrowed into the output
 * (in place or unpacked). */
static gs_status_t wire_message(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                gs_coll_t *d) {
  wire_call_t *w = d->extra;
  const gs_tensor_t *out = d->out ? d->out : d->in;
  if (gs_engine_on_device(e)) {
    double t0 = GS_TL_START();
    GS_CHECK(gs_wire_device_message(e, plan, m, d->in, out, w->residual, w->wire, d->pre, d->post));
    GS_TL_END("communicate (wire)", e->call, 1 + (m - plan->msgs), t0, m->count * 4);
    return GS_SUCCESS;
  }
  void *ibase = NULL, *obase = NULL, *buf = NULL;
  int icontig = gs_plan_contiguous(plan, m, d->in, &ibase);
  int ocontig = gs_plan_contiguous(plan, m, out, &obase);
  size_t n = (size_t)m->count;
  if (!icontig || !ocontig) GS_CHECK(gs_buffer_reserve(e, n * gs_dtype_size(m->dtype), &buf));
  float *work = NULL, *lost = NULL, *scratch = NULL;
  /* float32 output lying like the message: the work happens there (no
   * copy in, no copy out: two passes of the ~8 a wire call makes) */
  int in_out = ocontig && m->dtype == GS_FLOAT32;
  size_t slots = (in_out ? 0 : 1) + (w->residual ? 1 : 0);
  if (slots) GS_CHECK(gs_scratch_reserve(e, n * sizeof(float) * slots, (void **)&scratch));
  work = in_out ? obase : scratch;
  if (!icontig) GS_CHECK(gs_pack(e, plan, m, d->in, buf, 1.0));
  const void *src = icontig ? ibase : buf;
  if (src != (const void *)work || d->pre != 1.0)
    gs_wire_widen(m->dtype, src, work, m->count, d->pre);
  if (w->residual) {
    lost = in_out ? scratch : work + n;
    memset(lost, 0, n * sizeof(float));
    residual_slots(plan, m, w->residual, work, 1);
  }
  double t0 = GS_TL_START();
  if (gs_hier_wanted(e->comm, m->count * (int64_t)sizeof(float)))
    GS_CHECK(gs_hier_wire_allreduce(e->comm, work, m->count, w->wire, d->post, lost));
  else GS_CHECK(gs_wire_allreduce(e->comm, e->comm->mpi, work, m->count, w->wire, d->post, lost));
  GS_TL_END("communicate (wire)", e->call, 1 + (m - plan->msgs), t0, m->count * 4);
  if (w->residual) residual_slots(plan, m, w->residual, lost, 0);
  if (!in_out) gs_wire_narrow(m->dtype, work, ocontig ? obase : buf, m->count);
  if (!ocontig) GS_CHECK(gs_unpack(e, plan, m, buf, out, 1.0));
  return GS_SUCCESS;
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
