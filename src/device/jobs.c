/* The jobs of gs_cuda.h: a host list of runs (tensors, slots, slices) becomes
 * a table of work items of at most PIECE elements, one block each; the table
 * goes to the device through the kernel-table ring (ring.c: pinned host
 * memory and its device mirror, a region reused only after the kernel that
 * read it has finished), and results the host reads back through a pinned
 * buffer of the call's own. The host never hands CUDA a pageable buffer that
 * it frees before the device has read it, and never frees what a queued
 * kernel still reads. */
#include <stdlib.h>
#include <string.h>

#include "device/gs_cuda.h"

#ifdef GS_HAVE_CUDA

#define PIECE ((int64_t)1 << 14) /* elements per work item */
#define ALIGN 256                   /* of each part of a table */

typedef gs_cu_table_t table_t;

/* Copies host parts into the table back to back (each ALIGN-aligned) and
 * sends them to the device; dev[k] receives part k's device address. */
typedef struct part {
  const void *data; /* NULL: zero-filled */
  size_t bytes;
} part_t;

static size_t parts_bytes(const part_t *p, int n) {
  size_t total = 0;
  for (int k = 0; k < n; k++) total += (p[k].bytes + ALIGN - 1) / ALIGN * ALIGN;
  return total;
}

static gs_status_t upload(table_t *t, const part_t *p, int n, void **dev, void *stream) {
  size_t off = 0;
  for (int k = 0; k < n; k++) {
    if (p[k].data) memcpy(t->host + off, p[k].data, p[k].bytes);
    else memset(t->host + off, 0, p[k].bytes);
    dev[k] = t->dev + off;
    off += (p[k].bytes + ALIGN - 1) / ALIGN * ALIGN;
  }
  GS_CHECK(gs_cu_copy(t->dev, t->host, off, stream));
  t->sent = 1;
  return GS_SUCCESS;
}

/* Work items over runs of the given lengths (count_of(ctx, r)). */
static gs_status_t work_items(int64_t n, int64_t (*count_of)(const void *, int64_t),
                              const void *ctx, gs_cu_item_t **out, int64_t *nitems) {
  int64_t total = 0;
  for (int64_t r = 0; r < n; r++) total += (count_of(ctx, r) + PIECE - 1) / PIECE;
  gs_cu_item_t *items = malloc((size_t)(total ? total : 1) * sizeof *items);
  if (!items) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a kernel launch");
  int64_t k = 0;
  for (int64_t r = 0; r < n; r++)
    for (int64_t f = 0, c = count_of(ctx, r); f < c; f += PIECE)
      items[k++] = (gs_cu_item_t){r, f, c - f < PIECE ? c - f : PIECE};
  *out = items;
  *nitems = total;
  return GS_SUCCESS;
}

static int64_t run_count(const void *runs, int64_t r) {
  return ((const gs_cu_run_t *)runs)[r].count;
}
static int64_t float_count(const void *t, int64_t r) {
  const gs_tensor_t *x = &((const gs_tensor_t *)t)[r];
  return x->dtype <= GS_FLOAT64 ? x->count : 0; /* integers: always finite */
}
static int64_t slice_count(const void *c, int64_t j) { return ((const int64_t *)c)[j]; }

gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n, double scale,
                              void *stream) {
  gs_cu_item_t *items = NULL;
  int64_t nitems = 0;
  GS_CHECK(work_items(n, run_count, runs, &items, &nitems));
  part_t parts[2] = {{runs, (size_t)n * sizeof *runs}, {items, (size_t)nitems * sizeof *items}};
  table_t t;
  void *dev[2];
  gs_status_t s = nitems ? gs_cu_table_open(parts_bytes(parts, 2), stream, &t) : GS_SUCCESS;
  if (nitems && s == GS_SUCCESS) {
    s = upload(&t, parts, 2, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_elementwise(mode, dev[0], dev[1], nitems, scale, stream),
                         "gradsync: elementwise kernel launch");
    gs_status_t c = gs_cu_table_close(&t, stream);
    if (s == GS_SUCCESS) s = c;
  }
  free(items);
  return s;
}

gs_status_t gs_cu_nonfinite(const gs_tensor_t *tensors, int64_t n, int *bad, void *stream) {
  gs_cu_item_t *items = NULL;
  int64_t nitems = 0;
  *bad = 0;
  GS_CHECK(work_items(n, float_count, tensors, &items, &nitems));
  part_t parts[3] = {{NULL, sizeof(int)},
                     {tensors, (size_t)n * sizeof *tensors},
                     {items, (size_t)nitems * sizeof *items}};
  table_t t;
  void *dev[3];
  gs_cu_result_t *res = NULL;
  gs_status_t s = nitems ? gs_cu_result_get(sizeof *bad, &res) : GS_SUCCESS;
  if (nitems && s == GS_SUCCESS) s = gs_cu_table_open(parts_bytes(parts, 3), stream, &t);
  if (nitems && s == GS_SUCCESS) {
    s = upload(&t, parts, 3, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_nonfinite(dev[1], dev[2], nitems, dev[0], stream),
                         "gradsync: all_finite kernel launch");
    if (s == GS_SUCCESS) s = gs_cu_result_fetch(res, dev[0], sizeof *bad, stream);
    gs_status_t c = gs_cu_table_close(&t, stream);
    if (s == GS_SUCCESS) s = c;
    if (s == GS_SUCCESS) { /* the ring's lock is released: this wait holds up no launch */
      s = gs_cu_result_read(res, bad, sizeof *bad, "gs_all_finite: the finiteness check");
      res = NULL;
    }
  }
  gs_cu_result_put(res);
  free(items);
  return s;
}

gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, const int64_t *start,
                              const int64_t *count, int64_t n, double *d, void *stream) {
  if (n == 0) return GS_SUCCESS;
  gs_cu_item_t *items = NULL;
  int64_t nitems = 0;
  GS_CHECK(work_items(n, slice_count, count, &items, &nitems));
  gs_cu_slice_t *slices = malloc((size_t)n * sizeof *slices);
  int64_t *first_item = calloc((size_t)n + 1, sizeof *first_item);
  gs_status_t s = slices && first_item
                      ? GS_SUCCESS
                      : gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory for the dot products");
  for (int64_t j = 0; s == GS_SUCCESS && j < n; j++)
    slices[j] = (gs_cu_slice_t){start[j], count[j]};
  for (int64_t k = 0; s == GS_SUCCESS && k < nitems; k++) first_item[items[k].run + 1]++;
  for (int64_t j = 0; s == GS_SUCCESS && j < n; j++) first_item[j + 1] += first_item[j];
  part_t parts[5] = {{NULL, 3 * (size_t)n * sizeof(double)},
                     {slices, (size_t)n * sizeof *slices},
                     {items, (size_t)nitems * sizeof *items},
                     {first_item, ((size_t)n + 1) * sizeof *first_item},
                     {NULL, 3 * (size_t)(nitems ? nitems : 1) * sizeof(double)}};
  table_t t;
  void *dev[5];
  gs_cu_result_t *res = NULL;
  if (s == GS_SUCCESS) s = gs_cu_result_get(parts[0].bytes, &res);
  if (s == GS_SUCCESS) s = gs_cu_table_open(parts_bytes(parts, 5), stream, &t);
  if (s == GS_SUCCESS) {
    s = upload(&t, parts, 5, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_dots((int)dtype, a, b, dev[1], dev[2], nitems, dev[3], n,
                                           dev[4], dev[0], stream),
                         "gradsync: adasum dots kernel launch");
    if (s == GS_SUCCESS) s = gs_cu_result_fetch(res, dev[0], parts[0].bytes, stream);
    gs_status_t c = gs_cu_table_close(&t, stream);
    if (s == GS_SUCCESS) s = c;
    if (s == GS_SUCCESS) {
      s = gs_cu_result_read(res, d, parts[0].bytes, "adasum: the dot products");
      res = NULL;
    }
  }
  gs_cu_result_put(res);
  free(items);
  free(slices);
  free(first_item);
  return s;
}

gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count, const double *coef,
                                 int64_t n, void *stream) {
  gs_cu_item_t *items = NULL;
  int64_t nitems = 0;
  GS_CHECK(work_items(n, slice_count, count, &items, &nitems));
  gs_cu_slice_t *slices = malloc((size_t)(n ? n : 1) * sizeof *slices);
  gs_status_t s = slices ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  for (int64_t j = 0; s == GS_SUCCESS && j < n; j++)
    slices[j] = (gs_cu_slice_t){start[j], count[j]};
  part_t parts[3] = {{slices, (size_t)n * sizeof *slices},
                     {coef, 2 * (size_t)n * sizeof *coef},
                     {items, (size_t)nitems * sizeof *items}};
  table_t t;
  void *dev[3];
  if (s == GS_SUCCESS && nitems) {
    s = gs_cu_table_open(parts_bytes(parts, 3), stream, &t);
    if (s == GS_SUCCESS) {
      s = upload(&t, parts, 3, dev, stream);
      if (s == GS_SUCCESS)
        s = gs_cu_launched(
            gs_cu_launch_combine((int)dtype, a, b, out, dev[0], dev[1], dev[2], nitems, stream),
            "gradsync: adasum combine kernel launch");
      gs_status_t c = gs_cu_table_close(&t, stream);
      if (s == GS_SUCCESS) s = c;
    }
  }
  free(items);
  free(slices);
  return s;
}

/* The wire allreduce's passes: the runs (host) go up through the ring. */
gs_status_t gs_cu_wire_pass(gs_cu_wire_pass_t pass, gs_cu_wire_job_t job, const void *src,
                            void *dst, void *stream) {
  if (job.n == 0) return GS_SUCCESS;
  part_t parts[1] = {{job.runs, (size_t)job.nruns * sizeof *job.runs}};
  table_t t;
  void *dev[1];
  GS_CHECK(gs_cu_table_open(parts_bytes(parts, 1), stream, &t));
  gs_status_t s = upload(&t, parts, 1, dev, stream);
  job.runs = dev[0];
  if (s == GS_SUCCESS) {
    int e = pass == GS_CU_WIRE_ENCODE   ? gs_cu_launch_wire_encode(job, dst, stream)
            : pass == GS_CU_WIRE_REDUCE ? gs_cu_launch_wire_reduce(job, src, dst, stream)
                                        : gs_cu_launch_wire_decode(job, src, stream);
    s = gs_cu_launched(e, "gradsync: wire kernel launch");
  }
  gs_status_t c = gs_cu_table_close(&t, stream);
  return s == GS_SUCCESS ? c : s;
}

#endif
