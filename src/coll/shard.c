/* ZeRO-style sharded collectives with ONNX Runtime's padded layout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll/gs_collective.h"

gs_status_t gs_shard_layout(const int64_t *counts, int64_t n, int size, gs_shard_layout_t *layout,
                            int64_t *offsets, int *owners) {
  static const char fn[] = "gs_shard_layout";
  if (size <= 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: size must be positive, got %d", fn, size);
  if (n < 0 || (n > 0 && !counts) || !layout)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts, n or layout is invalid", fn);
  int64_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    if (counts[i] < 0 || counts[i] > ((int64_t)1 << 60))
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: count of tensor %lld is invalid: %lld", fn,
                     (long long)i, (long long)counts[i]);
    total += counts[i];
    if (total > ((int64_t)1 << 61))  /* leaves room for the padding below */
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: the tensors hold more than 2^61 elements "
                     "together",
                     fn);
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

/* The layout a shard call found in its checks. */
typedef struct shard_state {
  gs_shard_layout_t lay;
  int64_t *off;
  int *own;
} shard_state_t;

static void shard_release(gs_coll_t *d) {
  shard_state_t *st = d->extra;
  free(st->off);
  free(st->own);
  st->off = NULL;
  st->own = NULL;
}

/* One dtype, and a layout in which every tensor has one owner. */
static gs_status_t shard_check(gs_comm_t c, gs_coll_t *d) {
  const gs_tensor_t *t = d->in;
  int64_t n = d->n;
  shard_state_t *st = d->extra;
  for (int64_t i = 1; i < n; i++)
    if (t[i].dtype != t[0].dtype)
      return gs_fail(GS_ERR_TYPE,
                     "%s: all tensors of a shard call share one dtype; tensor 0 "
                     "is %s, tensor %lld is %s",
                     d->fn, gs_dtype_name(t[0].dtype), (long long)i, gs_dtype_name(t[i].dtype));
  int64_t *counts = malloc((size_t)(n > 0 ? n : 1) * sizeof *counts);
  st->off = malloc((size_t)(n > 0 ? n : 1) * sizeof *st->off);
  st->own = malloc((size_t)(n > 0 ? n : 1) * sizeof *st->own);
  gs_status_t s = GS_SUCCESS;
  if (!counts || !st->off || !st->own) s = gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++) counts[i] = t[i].count;
  if (s == GS_SUCCESS) {
    s = gs_shard_layout(counts, n, c->size, &st->lay, st->off, st->own);
    if (s != GS_SUCCESS) {
      char why[512]; /* gs_fail must not format gs_last_error() into itself */
      snprintf(why, sizeof why, "%s", gs_last_error());
      gs_fail(s, "%s: %s", d->fn, why);
    }
  }
  free(counts);
  return s;
}

/* Owned tensors into the padded buffer, one allgather, the others out. */
static gs_status_t allgather_shards_run(const gs_engine_t *e, gs_coll_t *d) {
  gs_comm_t c = e->comm;
  const gs_tensor_t *t = d->in;
  const shard_state_t *st = d->extra;
  int64_t n = d->n, nc = 0;
  int p = c->size;
  size_t es = gs_dtype_size(t[0].dtype);
  void *buf = NULL;
  int64_t *scratch = malloc(2 * (size_t)p * sizeof *scratch);
  gs_copy_t *copies = malloc((size_t)n * sizeof *copies);
  gs_status_t s = scratch && copies ? gs_buffer_reserve(e, (size_t)st->lay.padded * es, &buf)
                                    : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  if (s == GS_SUCCESS) {
    for (int r = 0; r < p; r++) {
      scratch[r] = st->lay.rank_count;
      scratch[p + r] = r * st->lay.rank_count;
    }
    for (int64_t i = 0; i < n; i++)
      if (st->own[i] == c->rank)
        copies[nc++] = (gs_copy_t){(char *)buf + (size_t)st->off[i] * es, t[i].data, t[i].count};
    s = gs_copy_batch(e, t[0].dtype, copies, nc, 1.0);
  }
  double t0 = GS_TL_START();
  if (s == GS_SUCCESS) s = e->transport->allgatherv(c, buf, scratch, scratch + p, t[0].dtype);
  GS_TL_END("communicate", e->call, 1, t0, st->lay.padded * (int64_t)es);
  nc = 0;
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
    if (st->own[i] != c->rank)
      copies[nc++] = (gs_copy_t){t[i].data, (char *)buf + (size_t)st->off[i] * es, t[i].count};
  if (s == GS_SUCCESS) s = gs_copy_batch(e, t[0].dtype, copies, nc, 1.0);
  free(scratch);
  free(copies);
  return s;
}

/* Every tensor into the padded buffer (padding zeroed), one reduce_scatter,
 * the owned tensors out. */
static gs_status_t reduce_scatter_shards_run(const gs_engine_t *e, gs_coll_t *d) {
  gs_comm_t c = e->comm;
  const gs_tensor_t *t = d->in;
  const shard_state_t *st = d->extra;
  int64_t n = d->n;
  int p = c->size;
  size_t es = gs_dtype_size(t[0].dtype);
  size_t send_bytes = ((size_t)st->lay.padded * es + 63) & ~(size_t)63;
  void *buf = NULL;
  int64_t *counts = malloc((size_t)p * sizeof *counts);
  gs_copy_t *copies = malloc((size_t)n * sizeof *copies);
  gs_status_t s = counts && copies
                      ? gs_buffer_reserve(e, send_bytes + (size_t)st->lay.rank_count * es, &buf)
                      : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  char *recv = (char *)buf + send_bytes;
  for (int r = 0; s == GS_SUCCESS && r < p; r++) counts[r] = st->lay.rank_count;
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
    copies[i] = (gs_copy_t){(char *)buf + (size_t)st->off[i] * es, t[i].data, t[i].count};
  if (s == GS_SUCCESS) s = gs_copy_batch(e, t[0].dtype, copies, n, d->pre);
  /* the padding is reduced too: give it defined values */
  if (s == GS_SUCCESS)
    s = gs_zero_bytes(e, (char *)buf + (size_t)st->lay.total * es,
                      (size_t)(st->lay.padded - st->lay.total) * es);
  double t0 = GS_TL_START();
  if (s == GS_SUCCESS) s = e->transport->reduce_scatter(c, buf, recv, counts, t[0].dtype, d->op);
  GS_TL_END("communicate", e->call, 1, t0, st->lay.padded * (int64_t)es);
  int64_t base = (int64_t)c->rank * st->lay.rank_count, nc = 0;
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
    if (st->own[i] == c->rank)
      copies[nc++] = (gs_copy_t){t[i].data, recv + (size_t)(st->off[i] - base) * es, t[i].count};
  if (s == GS_SUCCESS) s = gs_copy_batch(e, t[0].dtype, copies, nc, d->post);
  free(counts);
  free(copies);
  return s;
}

gs_status_t gs_allgather_shards(gs_comm_t c, const gs_tensor_t *t, int64_t n) {
  shard_state_t st = {{0, 0, 0}, NULL, NULL};
  gs_coll_t d = {.fn = "gs_allgather_shards",
                 .name = "allgather_shards",
                 .kind = GS_CALL_ALLGATHER_SHARDS,
                 .in = t,
                 .in_name = "tensors",
                 .n = n,
                 .op = GS_OP_SUM,
                 .extra = &st,
                 .check = shard_check,
                 .run = allgather_shards_run,
                 .release = shard_release};
  return gs_collective(c, &d);
}

gs_status_t gs_reduce_scatter_shards(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_op_t op,
                                     double prescale, double postscale) {
  shard_state_t st = {{0, 0, 0}, NULL, NULL};
  gs_coll_t d = {.fn = "gs_reduce_scatter_shards",
                 .name = "reduce_scatter_shards",
                 .kind = GS_CALL_REDUCE_SCATTER_SHARDS,
                 .in = t,
                 .in_name = "tensors",
                 .n = n,
                 .op = op,
                 .pre = prescale,
                 .post = postscale,
                 .extra = &st,
                 .op_checked = 1,
                 .check = shard_check,
                 .run = reduce_scatter_shards_run,
                 .release = shard_release};
  return gs_collective(c, &d);
}
