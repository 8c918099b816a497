/* ZeRO-style sharded collectives with ONNX Runtime's padded layout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

gs_status_t gs_shard_layout(const int64_t *counts, int64_t n, int size,
                            gs_shard_layout_t *layout, int64_t *offsets, int *owners) {
  static const char fn[] = "gs_shard_layout";
  if (size <= 0) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: size must be positive, got %d", fn, size);
  if (n < 0 || (n > 0 && !counts) || !layout)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts, n or layout is invalid", fn);
  int64_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    if (counts[i] < 0 || counts[i] > ((int64_t)1 << 60))
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: count of tensor %lld is invalid: %lld", fn,
                     (long long)i, (long long)counts[i]);
    total += counts[i];
    if (total > ((int64_t)1 << 61))  /* leaves room for the padding below */
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: the tensors hold more than 2^61 elements "
                     "together", fn);
  }
  int64_t align = (int64_t)size * 32;
  layout->total = total;
  layout->padded = total + align - total % align; /* ORT always adds a block */
  layout->rank_count = layout->padded / size;
  int64_t off = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t owner = off / layout->rank_count;
    if (off + counts[i] > (owner + 1) * layout->rank_count)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: tensor %lld (elements %lld to %lld) crosses the boundary of rank %lld's "
                     "range [%lld, %lld): a single rank must own the entire tensor",
                     fn, (long long)i, (long long)off, (long long)(off + counts[i]),
                     (long long)owner, (long long)(owner * layout->rank_count),
                     (long long)((owner + 1) * layout->rank_count));
    if (offsets) offsets[i] = off;
    if (owners) owners[i] = (int)owner;
    off += counts[i];
  }
  return GS_SUCCESS;
}

/* Shared prologue: argument checks, validation and the layout. On success
 * *offsets and *owners hold n entries each (free with free()). */
static gs_status_t shard_begin(gs_comm_t c, const char *fn, gs_call_kind_t kind,
                               const gs_tensor_t *t, int64_t n, gs_op_t op, double pre,
                               double post, gs_shard_layout_t *lay, int64_t **offsets,
                               int **owners) {
  *offsets = NULL;
  *owners = NULL;
  gs_status_t local = gs_check_tensors(fn, "tensors", t, n);
  for (int64_t i = 1; local == GS_SUCCESS && i < n; i++)
    if (t[i].dtype != t[0].dtype)
      local = gs_fail(GS_ERR_TYPE, "%s: all tensors of a shard call share one dtype; tensor 0 "
                      "is %s, tensor %lld is %s", fn, gs_dtype_name(t[0].dtype), (long long)i,
                      gs_dtype_name(t[i].dtype));
  if (local == GS_SUCCESS && kind == GS_CALL_REDUCE_SCATTER_SHARDS)
    local = gs_check_op(fn, op, t, n, pre, post, 0);
  if (local == GS_SUCCESS) local = gs_check_memory(c, fn, t, n, NULL, 0);
  int64_t *counts = malloc((size_t)(n > 0 ? n : 1) * sizeof *counts);
  *offsets = malloc((size_t)(n > 0 ? n : 1) * sizeof **offsets);
  *owners = malloc((size_t)(n > 0 ? n : 1) * sizeof **owners);
  if (local == GS_SUCCESS && (!counts || !*offsets || !*owners))
    local = gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  for (int64_t i = 0; local == GS_SUCCESS && i < n; i++) counts[i] = t[i].count;
  if (local == GS_SUCCESS) {
    local = gs_shard_layout(counts, n, c->size, lay, *offsets, *owners);
    if (local != GS_SUCCESS) {
      char why[512]; /* gs_fail must not format gs_last_error() into itself */
      snprintf(why, sizeof why, "%s", gs_last_error());
      gs_fail(local, "%s: %s", fn, why);
    }
  }
  free(counts);
  gs_call_t call = {kind, op, 0, n, t, NULL, NULL, 0};
  gs_status_t s = gs_begin_call(c, &call, local);
  if (s != GS_SUCCESS) {
    free(*offsets);
    free(*owners);
    *offsets = NULL;
    *owners = NULL;
  }
  return s;
}

static gs_status_t allgather_shards_impl(gs_comm_t c, const gs_tensor_t *t, int64_t n) {
  static const char fn[] = "gs_allgather_shards";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  gs_shard_layout_t lay;
  int64_t *off;
  int *own;
  GS_CHECK(shard_begin(c, fn, GS_CALL_ALLGATHER_SHARDS, t, n, GS_OP_SUM, 1.0, 1.0, &lay, &off, &own));
  gs_status_t s = GS_SUCCESS;
  if (n > 0) {
    size_t es = gs_dtype_size(t[0].dtype);
    void *buf = NULL;
    int p = c->size;
    gs_engine_t e;
    int64_t *scratch = malloc(2 * (size_t)p * sizeof *scratch);
    gs_copy_t *copies = malloc((size_t)n * sizeof *copies);
    s = scratch && copies ? gs_engine_open(c, t, n, &e)
                          : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (s != GS_SUCCESS) e.device = -1;
    if (s == GS_SUCCESS) s = gs_buffer_reserve(&e, (size_t)lay.padded * es, &buf);
    int64_t nc = 0;
    if (s == GS_SUCCESS) {
      for (int r = 0; r < p; r++) { scratch[r] = lay.rank_count; scratch[p + r] = r * lay.rank_count; }
      for (int64_t i = 0; i < n; i++)
        if (own[i] == c->rank)
          copies[nc++] = (gs_copy_t){(char *)buf + (size_t)off[i] * es, t[i].data, t[i].count};
      s = gs_copy_batch(&e, t[0].dtype, copies, nc, 1.0);
    }
    double t0 = GS_TL_START();
    if (s == GS_SUCCESS) s = e.transport->allgatherv(c, buf, scratch, scratch + p, t[0].dtype);
    GS_TL_END("communicate", "allgather_shards", 1, t0, lay.padded * (int64_t)es);
    nc = 0;
    for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
      if (own[i] != c->rank)
        copies[nc++] = (gs_copy_t){t[i].data, (char *)buf + (size_t)off[i] * es, t[i].count};
    if (s == GS_SUCCESS) s = gs_copy_batch(&e, t[0].dtype, copies, nc, 1.0);
    s = gs_engine_close(&e, s);
    free(scratch);
    free(copies);
  }
  free(off);
  free(own);
  return s;
}

static gs_status_t reduce_scatter_shards_impl(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_op_t op,
                                     double prescale, double postscale) {
  static const char fn[] = "gs_reduce_scatter_shards";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  gs_shard_layout_t lay;
  int64_t *off;
  int *own;
  GS_CHECK(shard_begin(c, fn, GS_CALL_REDUCE_SCATTER_SHARDS, t, n, op, prescale, postscale,
                       &lay, &off, &own));
  gs_status_t s = GS_SUCCESS;
  if (n > 0) {
    size_t es = gs_dtype_size(t[0].dtype);
    int p = c->size;
    size_t send_bytes = ((size_t)lay.padded * es + 63) & ~(size_t)63;
    void *buf = NULL;
    gs_engine_t e;
    int64_t *counts = malloc((size_t)p * sizeof *counts);
    gs_copy_t *copies = malloc((size_t)n * sizeof *copies);
    s = counts && copies ? gs_engine_open(c, t, n, &e)
                         : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (s != GS_SUCCESS) e.device = -1;
    if (s == GS_SUCCESS) s = gs_buffer_reserve(&e, send_bytes + (size_t)lay.rank_count * es, &buf);
    if (s == GS_SUCCESS) {
      char *recv = (char *)buf + send_bytes;
      for (int r = 0; r < p; r++) counts[r] = lay.rank_count;
      for (int64_t i = 0; i < n; i++)
        copies[i] = (gs_copy_t){(char *)buf + (size_t)off[i] * es, t[i].data, t[i].count};
      s = gs_copy_batch(&e, t[0].dtype, copies, n, prescale);
      /* the padding is reduced too: give it defined values */
      if (s == GS_SUCCESS)
        s = gs_zero_bytes(&e, (char *)buf + (size_t)lay.total * es,
                          (size_t)(lay.padded - lay.total) * es);
      double t0 = GS_TL_START();
      if (s == GS_SUCCESS) s = e.transport->reduce_scatter(c, buf, recv, counts, t[0].dtype, op);
      GS_TL_END("communicate", "reduce_scatter_shards", 1, t0, lay.padded * (int64_t)es);
      double post = op == GS_OP_AVERAGE ? postscale * (1.0 / p) : postscale;
      int64_t base = (int64_t)c->rank * lay.rank_count, nc = 0;
      for (int64_t i = 0; i < n; i++)
        if (own[i] == c->rank)
          copies[nc++] = (gs_copy_t){t[i].data, recv + (size_t)(off[i] - base) * es, t[i].count};
      if (s == GS_SUCCESS) s = gs_copy_batch(&e, t[0].dtype, copies, nc, post);
    }
    s = gs_engine_close(&e, s);
    free(counts);
    free(copies);
  }
  free(off);
  free(own);
  return s;
}

gs_status_t gs_allgather_shards(gs_comm_t c, const gs_tensor_t *t, int64_t n) {
  gs_enter_runtime();
  gs_status_t s = allgather_shards_impl(c, t, n);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_reduce_scatter_shards(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_op_t op, double prescale, double postscale) {
  gs_enter_runtime();
  gs_status_t s = reduce_scatter_shards_impl(c, t, n, op, prescale, postscale);
  gs_leave_runtime();
  return s;
}
