/* The fusion engine: one offset table per call, shared by packing,
 * unpacking and Adasum's per-tensor boundaries, and the packing and
 * unpacking themselves (host loops, or one device launch per message). */
#include <stdlib.h>
#include <string.h>

#include "engine/gs_engine.h"

void gs_plan_free(gs_plan_t *plan) {
  if (plan->slots != plan->inline_slots) free(plan->slots);
  if (plan->msgs != plan->inline_msgs) free(plan->msgs);
  plan->slots = NULL;
  plan->msgs = NULL;
  plan->nslots = plan->nmsgs = 0;
}

gs_status_t gs_plan_build(gs_plan_t *plan, const int64_t *counts, const gs_dtype_t *dtypes,
                          int64_t n, int64_t threshold, int64_t direct) {
  plan->nslots = plan->nmsgs = 0;
  plan->slots = plan->inline_slots;
  plan->msgs = plan->inline_msgs;
  if (n == 0) return GS_SUCCESS;
  if (n > GS_PLAN_INLINE) {
    plan->slots = malloc((size_t)n * sizeof *plan->slots);
    plan->msgs = malloc((size_t)n * sizeof *plan->msgs);
  }
  if (!plan->slots || !plan->msgs) {
    gs_plan_free(plan);
    return gs_fail(GS_ERR_NO_MEMORY, "fusion plan: out of memory for %lld tensors", (long long)n);
  }
  /* dtype groups in order of first appearance */
  gs_dtype_t order[GS_NUM_DTYPES];
  int ngroups = 0, seen[GS_NUM_DTYPES] = {0};
  for (int64_t i = 0; i < n && ngroups < GS_NUM_DTYPES; i++)
    if (!seen[dtypes[i]]) {
      seen[dtypes[i]] = 1;
      order[ngroups++] = dtypes[i];
    }

  for (int g = 0; g < ngroups; g++) {
    gs_dtype_t d = order[g];
    int64_t es = (int64_t)gs_dtype_size(d);
    gs_message_t *open = NULL; /* message still taking tensors */
    for (int64_t i = 0; i < n; i++) {
      if (dtypes[i] != d) continue;
      int64_t bytes = counts[i] * es;
      int alone = bytes > threshold || (bytes >= direct && bytes > 0);
      if (alone || !open || (open->count * es + bytes > threshold && open->count > 0)) {
        open = &plan->msgs[plan->nmsgs++];
        open->dtype = d;
        open->first = plan->nslots;
        open->nslots = 0;
        open->count = 0;
      }
      gs_slot_t *s = &plan->slots[plan->nslots++];
      s->tensor = i;
      s->offset = open->count;
      s->count = counts[i];
      open->nslots++;
      open->count += counts[i];
      if (alone) open = NULL;
    }
  }
  return GS_SUCCESS;
}

/* Plans a list for a call: counts and dtypes straight from the tensors. */
gs_status_t gs_plan_tensors(gs_plan_t *plan, const gs_tensor_t *t, int64_t n, gs_comm_t comm,
                            int fuse_direct) {
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
    s = gs_plan_build(plan, counts, dtypes, n, comm->fusion_threshold,
                      fuse_direct ? INT64_MAX : comm->direct_bytes);
  if (!small) {
    free(counts);
    free(dtypes);
  }
  return s;
}

int gs_plan_contiguous(const gs_plan_t *plan, const gs_message_t *m, const gs_tensor_t *t,
                       void **base) {
  size_t es = gs_dtype_size(m->dtype);
  char *b = NULL;
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    const gs_slot_t *s = &plan->slots[k];
    if (s->count == 0) continue;
    char *p = (char *)t[s->tensor].data;
    if (!b) b = p - (size_t)s->offset * es;
    else if (p != b + (size_t)s->offset * es) return 0;
  }
  *base = b;
  return 1;
}

/* The part of slot s inside message elements [first, end), as message
 * elements [*lo, *hi); 0 when they do not overlap. */
static int overlap(const gs_slot_t *s, int64_t first, int64_t end, int64_t *lo, int64_t *hi) {
  *lo = s->offset > first ? s->offset : first;
  *hi = s->offset + s->count < end ? s->offset + s->count : end;
  return *lo < *hi;
}

/* Pack and unpack on a device: every slot in the range in one launch. */
static gs_status_t device_copy_slots(const gs_engine_t *e, const gs_plan_t *plan,
                                     const gs_message_t *m, const gs_tensor_t *t, void *buf,
                                     double scale, int unpack, int64_t first, int64_t end) {
  size_t es = gs_dtype_size(m->dtype);
  gs_cu_run_t small[GS_PLAN_INLINE];
  gs_cu_run_t *runs =
      m->nslots <= GS_PLAN_INLINE ? small : malloc((size_t)m->nslots * sizeof *runs);
  if (!runs) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory packing a message");
  int64_t n = 0, lo, hi;
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    const gs_slot_t *s = &plan->slots[k];
    if (!overlap(s, first, end, &lo, &hi)) continue;
    char *slot = (char *)buf + (size_t)(lo - first) * es;
    char *tensor = (char *)t[s->tensor].data + (size_t)(lo - s->offset) * es;
    runs[n++] = (gs_cu_run_t){unpack ? (void *)tensor : slot, unpack ? (void *)slot : tensor,
                              hi - lo, (int32_t)m->dtype, (int32_t)m->dtype};
  }
  gs_status_t st = n ? gs_cu_elementwise(GS_CU_COPY_SCALE, runs, n, scale, e->stream) : GS_SUCCESS;
  if (runs != small) free(runs);
  return st;
}

/* Copies message elements [first, first + count) between the tensors and
 * buf (element `first` at buf[0]), times scale. */
static gs_status_t copy_slots(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                              const gs_tensor_t *t, void *buf, double scale, int unpack,
                              int64_t first, int64_t count) {
  double t0 = GS_TL_START();
  size_t es = gs_dtype_size(m->dtype);
  int64_t end = first + count;
  gs_status_t st = GS_SUCCESS;
  if (e->device >= 0) {
    st = device_copy_slots(e, plan, m, t, buf, scale, unpack, first, end);
  } else {
    int64_t lo, hi;
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      const gs_slot_t *s = &plan->slots[k];
      if (!overlap(s, first, end, &lo, &hi)) continue;
      char *slot = (char *)buf + (size_t)(lo - first) * es;
      char *tensor = (char *)t[s->tensor].data + (size_t)(lo - s->offset) * es;
      gs_cpu_scale_copy(m->dtype, unpack ? slot : tensor, unpack ? tensor : slot, hi - lo, scale);
    }
  }
  GS_TL_END(unpack ? "unpack" : "pack", e->call, 1 + (m - plan->msgs), t0, count * (int64_t)es);
  return st;
}

gs_status_t gs_pack_range(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                          const gs_tensor_t *t, void *buf, double scale, int64_t first,
                          int64_t count) {
  return copy_slots(e, plan, m, t, buf, scale, 0, first, count);
}

gs_status_t gs_unpack_range(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                            const void *buf, const gs_tensor_t *t, double scale, int64_t first,
                            int64_t count) {
  return copy_slots(e, plan, m, t, (void *)buf, scale, 1, first, count);
}

/* Elements per piece of gs_unpack_fold: 16 KiB of float32, so the piece
 * stays in L1 while every rank's copy is folded into it. */
#define FOLD_PIECE 4096

void gs_unpack_fold(const gs_plan_t *plan, const gs_message_t *m, const void *const *bufs,
                    size_t at, int p, gs_op_t op, const gs_tensor_t *t, double scale) {
  size_t es = gs_dtype_size(m->dtype);
  for (int64_t k = m->first; k < m->first + m->nslots; k++) {
    const gs_slot_t *s = &plan->slots[k];
    char *dst = t[s->tensor].data;
    for (int64_t done = 0; done < s->count; done += FOLD_PIECE) {
      int64_t n = s->count - done < FOLD_PIECE ? s->count - done : FOLD_PIECE;
      size_t from = at + (size_t)(s->offset + done) * es;
      char *to = dst + (size_t)done * es;
      memcpy(to, (const char *)bufs[0] + from, (size_t)n * es);
      for (int r = 1; r < p; r++) gs_cpu_reduce(m->dtype, op, (const char *)bufs[r] + from, to, n);
      if (scale != 1.0) gs_cpu_scale_copy(m->dtype, to, to, n, scale);
    }
  }
}

gs_status_t gs_pack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                    const gs_tensor_t *t, void *buf, double scale) {
  return copy_slots(e, plan, m, t, buf, scale, 0, 0, m->count);
}

gs_status_t gs_unpack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                      const void *buf, const gs_tensor_t *t, double scale) {
  return copy_slots(e, plan, m, t, (void *)buf, scale, 1, 0, m->count);
}
