/* The jobs of gs_cuda.h: a host list of runs (tensors, slots, slices) becomes
 * a table of work items of at most PIECE elements, one block each; the table
 * goes to the device through a per-device ring of pinned host memory and
 * its device mirror, and a region of the ring is reused only after the event
 * recorded behind the kernel that read it has completed. The host never
 * hands CUDA a pageable buffer that it frees before the device has read it,
 * and never frees what a queued kernel still reads. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gs_cuda.h"

#ifdef GS_HAVE_CUDA

#define MAX_DEVICES 64
#define PIECE ((int64_t)1 << 14)     /* elements per work item */
#define RING_MIN ((size_t)1 << 20)   /* bytes of table ring per device, to start */
#define ALIGN 256

typedef struct segment {
  size_t off, len;
  void *event; /* behind the launch that read it */
  int held;    /* results in it are still to be read by the host */
} segment_t;

typedef struct ring {
  pthread_mutex_t lock;
  char *host, *dev;
  size_t bytes, head;
  segment_t *segs; /* in allocation order */
  size_t nsegs, cap;
} ring_t;

static ring_t rings[MAX_DEVICES];
static pthread_once_t rings_once = PTHREAD_ONCE_INIT;

static void init_rings(void) {
  for (int d = 0; d < MAX_DEVICES; d++) pthread_mutex_init(&rings[d].lock, NULL);
}

/* Drops finished regions from the front; waits for the front one when
 * `wait` (polling, with timeouts). */
static gs_status_t reclaim(ring_t *r, int wait) {
  while (r->nsegs) {
    segment_t *s = &r->segs[0];
    int done = s->held ? 0 : gs_cu_event_poll(s->event, "gradsync: a kernel table's launch");
    if (done < 0) return GS_ERR_CUDA;
    if (!done) {
      if (!wait || s->held) return GS_SUCCESS;
      GS_CHECK(gs_cu_event_wait(s->event, "gradsync: waiting for a kernel table to be free"));
    }
    gs_cu_event_free(s->event);
    memmove(r->segs, r->segs + 1, --r->nsegs * sizeof *r->segs);
  }
  return GS_SUCCESS;
}

/* Replaces the ring's memory with at least `need` bytes; nothing is in use. */
static gs_status_t regrow(ring_t *r, size_t need, void *stream) {
  size_t want = r->bytes ? 2 * r->bytes : RING_MIN;
  while (want < need) want *= 2;
  gs_cu_release(r->host, 1);
  if (r->dev) gs_cu_free_async(r->dev, stream);
  r->host = r->dev = NULL;
  r->bytes = r->head = 0;
  size_t have = 0;
  GS_CHECK(gs_cu_grow_pinned((void **)&r->host, &have, want, stream));
  GS_CHECK(gs_cu_malloc_async((void **)&r->dev, want, stream, "gradsync: a kernel table ring"));
  r->bytes = want;
  return GS_SUCCESS;
}

/* Where `len` bytes fit without touching a region still in use, or -1. */
static long fit(const ring_t *r, size_t len) {
  size_t tail = r->nsegs ? r->segs[0].off : r->head;
  if (!r->nsegs) return len <= r->bytes ? 0 : -1;
  /* strictly below the tail: head == tail then always means empty */
  if (r->head > tail) { /* used: [tail, head) */
    if (r->head + len <= r->bytes) return (long)r->head;
    return len < tail ? 0 : -1;
  }
  return r->head + len < tail ? (long)r->head : -1; /* used: [tail, end) + [0, head) */
}

typedef struct table {
  ring_t *ring;
  size_t off, len;
  char *host, *dev;
} table_t;

/* Reserves `len` bytes of the current device's ring (the lock is held until
 * table_close). */
static gs_status_t table_open(size_t len, void *stream, table_t *t) {
  int device = 0;
  pthread_once(&rings_once, init_rings);
  GS_CHECK(gs_cuda_get_device(&device));
  if (device < 0 || device >= MAX_DEVICES)
    return gs_fail(GS_ERR_UNSUPPORTED, "gradsync: CUDA device %d is beyond the %d supported",
                   device, MAX_DEVICES);
  ring_t *r = &rings[device];
  pthread_mutex_lock(&r->lock);
  len = (len + ALIGN - 1) / ALIGN * ALIGN;
  gs_status_t s = reclaim(r, 0);
  long at = -1;
  while (s == GS_SUCCESS && (at = fit(r, len)) < 0) {
    if (len > r->bytes || !r->nsegs) {
      s = reclaim(r, 1); /* everything, then room for it */
      if (s == GS_SUCCESS && r->nsegs == 0) s = regrow(r, len, stream);
    } else {
      size_t before = r->nsegs;
      s = reclaim(r, 1);
      if (s == GS_SUCCESS && r->nsegs == before) /* the front is held by a reader */
        s = gs_fail(GS_ERR_INTERNAL,
                    "gradsync: the kernel table ring is full of results "
                    "not yet read");
    }
  }
  if (s != GS_SUCCESS) {
    pthread_mutex_unlock(&r->lock);
    return s;
  }
  *t = (table_t){r, (size_t)at, len, r->host + at, r->dev + at};
  return GS_SUCCESS;
}

/* Records the event behind the launch; `held`: results in the region are
 * read by the host after waiting (table_release). Releases the lock. */
static gs_status_t table_close(table_t *t, void *stream, int held, void **event) {
  ring_t *r = t->ring;
  gs_status_t s = GS_SUCCESS;
  if (r->nsegs == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 64;
    segment_t *n = realloc(r->segs, cap * sizeof *n);
    if (!n) s = gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a kernel table");
    else r->segs = n, r->cap = cap;
  }
  void *ev = NULL;
  if (s == GS_SUCCESS) s = gs_cu_record(stream, &ev, "gradsync: after a kernel launch");
  if (s == GS_SUCCESS) {
    r->segs[r->nsegs++] = (segment_t){t->off, t->len, ev, held};
    r->head = t->off + t->len;
    if (event) *event = ev;
  }
  pthread_mutex_unlock(&r->lock);
  return s;
}

static void table_release(table_t *t) {
  pthread_mutex_lock(&t->ring->lock);
  for (size_t k = 0; k < t->ring->nsegs; k++)
    if (t->ring->segs[k].off == t->off) t->ring->segs[k].held = 0;
  pthread_mutex_unlock(&t->ring->lock);
}

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
  return gs_cu_copy(t->dev, t->host, off, stream);
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
  gs_status_t s = nitems ? table_open(parts_bytes(parts, 2), stream, &t) : GS_SUCCESS;
  if (nitems && s == GS_SUCCESS) {
    s = upload(&t, parts, 2, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_elementwise(mode, dev[0], dev[1], nitems, scale, stream),
                         "gradsync: elementwise kernel launch");
    gs_status_t c = table_close(&t, stream, 0, NULL);
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
  void *dev[3], *ev = NULL;
  gs_status_t s = nitems ? table_open(parts_bytes(parts, 3), stream, &t) : GS_SUCCESS;
  if (nitems && s == GS_SUCCESS) {
    s = upload(&t, parts, 3, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_nonfinite(dev[1], dev[2], nitems, dev[0], stream),
                         "gradsync: all_finite kernel launch");
    if (s == GS_SUCCESS) s = gs_cu_copy(t.host, dev[0], sizeof(int), stream);
    gs_status_t c = table_close(&t, stream, 1, &ev);
    if (s == GS_SUCCESS) s = c;
    if (s == GS_SUCCESS) s = gs_cu_event_wait(ev, "gs_all_finite: the finiteness check");
    if (s == GS_SUCCESS) memcpy(bad, t.host, sizeof *bad);
    table_release(&t);
  }
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
  void *dev[5], *ev = NULL;
  if (s == GS_SUCCESS) s = table_open(parts_bytes(parts, 5), stream, &t);
  if (s == GS_SUCCESS) {
    s = upload(&t, parts, 5, dev, stream);
    if (s == GS_SUCCESS)
      s = gs_cu_launched(gs_cu_launch_dots((int)dtype, a, b, dev[1], dev[2], nitems, dev[3], n,
                                           dev[4], dev[0], stream),
                         "gradsync: adasum dots kernel launch");
    if (s == GS_SUCCESS) s = gs_cu_copy(t.host, dev[0], parts[0].bytes, stream);
    gs_status_t c = table_close(&t, stream, 1, &ev);
    if (s == GS_SUCCESS) s = c;
    if (s == GS_SUCCESS) s = gs_cu_event_wait(ev, "adasum: the dot products");
    if (s == GS_SUCCESS) memcpy(d, t.host, parts[0].bytes);
    table_release(&t);
  }
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
    s = table_open(parts_bytes(parts, 3), stream, &t);
    if (s == GS_SUCCESS) {
      s = upload(&t, parts, 3, dev, stream);
      if (s == GS_SUCCESS)
        s = gs_cu_launched(
            gs_cu_launch_combine((int)dtype, a, b, out, dev[0], dev[1], dev[2], nitems, stream),
            "gradsync: adasum combine kernel launch");
      gs_status_t c = table_close(&t, stream, 0, NULL);
      if (s == GS_SUCCESS) s = c;
    }
  }
  free(items);
  free(slices);
  return s;
}

#endif
