/* The kernel-table ring and the result buffers of gs_cuda.h.
 *
 * Tables: per device, a current arena (pinned host memory and its device
 * mirror) used as a ring, plus the older arenas it replaced, each freed once
 * the last launch that read it has finished. A region is reused only after
 * the event recorded behind its launch has completed, and only that event
 * frees it: nothing the host still has to read lives in the ring, so no
 * region waits on a reader. A table that does not fit gets a new, larger
 * arena (the old one drains on its own) while the ring is under RING_MAX;
 * past it, the opener waits for launches to finish by polling with the
 * ring's lock released (gs_progress_wait: timeouts, interrupts, the runtime
 * lock released), so whatever it waits for can always make progress.
 *
 * Results (all_finite's flag, Adasum's dots) go to a pinned buffer of the
 * call's own, from a small pool; one whose copy was not seen to finish (a
 * wait that gave up) is reused only after it has. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/gs_cuda.h"

#ifdef GS_HAVE_CUDA

#define MAX_DEVICES 64
#define RING_MIN ((size_t)1 << 20)  /* bytes of the first arena */
#define RING_MAX ((size_t)16 << 20) /* past this, a full ring waits rather than grows */
#define ALIGN 256

typedef struct segment {
  size_t off, len;
  void *event; /* behind the launch that read it; NULL: never known to finish */
} segment_t;

typedef struct arena {
  char *host, *dev;
  size_t bytes, head;
  segment_t *segs; /* in allocation order */
  size_t nsegs, cap;
  void *ready;        /* after dev's allocation, until seen complete */
  struct arena *next; /* the older arenas, draining */
} arena_t;

typedef struct ring {
  pthread_mutex_t lock;
  arena_t *cur, *old;
  size_t bytes; /* of every arena */
  void *side;   /* where the mirrors are allocated and freed */
  int device;
} ring_t;

static ring_t rings[MAX_DEVICES];
static pthread_once_t rings_once = PTHREAD_ONCE_INIT;

static void init_rings(void) {
  for (int d = 0; d < MAX_DEVICES; d++) {
    pthread_mutex_init(&rings[d].lock, NULL);
    rings[d].device = d;
  }
}

/* Drops the front regions whose launches finished; -1 on a CUDA error. */
static int drain(arena_t *a) {
  size_t k = 0;
  int done = 1;
  while (k < a->nsegs && a->segs[k].event &&
         (done = gs_cu_event_poll(a->segs[k].event, "gradsync: a kernel table's launch")) > 0)
    gs_cu_event_free(a->segs[k++].event);
  memmove(a->segs, a->segs + k, (a->nsegs - k) * sizeof *a->segs);
  a->nsegs -= k;
  return done < 0 ? -1 : 0;
}

/* Every launch that read the arena has finished (the host saw its event),
 * so any stream's free is ordered after them. */
static void arena_free(ring_t *r, arena_t *a) {
  r->bytes -= a->bytes;
  gs_cu_release(a->host);
  gs_cu_free_async(a->dev, r->side);
  gs_cu_event_free(a->ready);
  free(a->segs);
  free(a);
}

static gs_status_t reclaim(ring_t *r) {
  if (r->cur && drain(r->cur) < 0) return GS_ERR_CUDA;
  for (arena_t **p = &r->old; *p;) {
    arena_t *a = *p;
    if (drain(a) < 0) return GS_ERR_CUDA;
    if (a->nsegs) {
      p = &a->next;
    } else {
      *p = a->next;
      arena_free(r, a);
    }
  }
  return GS_SUCCESS;
}

/* Where `len` bytes fit in the arena without touching a region in use, or -1. */
static long fit(const arena_t *a, size_t len) {
  if (!a->nsegs) return len <= a->bytes ? 0 : -1;
  size_t tail = a->segs[0].off;
  /* strictly below the tail: head == tail then always means empty */
  if (a->head > tail) { /* used: [tail, head) */
    if (a->head + len <= a->bytes) return (long)a->head;
    return len < tail ? 0 : -1;
  }
  return a->head + len < tail ? (long)a->head : -1; /* used: [tail, end) + [0, head) */
}

static size_t next_size(const ring_t *r, size_t len) {
  size_t want = r->cur ? 2 * r->cur->bytes : RING_MIN;
  while (want < len) want *= 2;
  return want;
}

/* Whether a new arena for `len` may be made now: the ring stays under
 * RING_MAX, or nothing is in use (a table larger than RING_MAX waits for
 * everything else to finish, then gets an arena alone). */
static int may_grow(const ring_t *r, size_t len) {
  int idle = !r->cur || !r->cur->nsegs;
  if (idle && !r->old) return 1;
  return r->bytes - (idle ? r->cur->bytes : 0) + next_size(r, len) <= RING_MAX;
}

/* A new current arena of at least `len` bytes; the old one is freed when
 * idle, else drains. The mirror is allocated on the side stream, where
 * nothing else runs: `ready` completes at once and orders every stream's
 * use after the allocation. */
static gs_status_t grow(ring_t *r, size_t len) {
  if (!r->side) GS_CHECK(gs_cu_alloc_stream(r->device, &r->side));
  arena_t *a = calloc(1, sizeof *a);
  if (!a) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a kernel table ring");
  size_t want = next_size(r, len), have = 0;
  gs_status_t s = gs_cu_grow_pinned((void **)&a->host, &have, want, NULL);
  if (s == GS_SUCCESS)
    s = gs_cu_malloc_async((void **)&a->dev, have, r->side, "gradsync: a kernel table ring");
  if (s == GS_SUCCESS) s = gs_cu_record(r->side, &a->ready, "gradsync: a kernel table ring");
  if (s != GS_SUCCESS) {
    gs_cu_release(a->host);
    gs_cu_free_async(a->dev, r->side);
    free(a);
    return s;
  }
  a->bytes = have;
  r->bytes += have;
  if (r->cur && !r->cur->nsegs) {
    arena_free(r, r->cur);
  } else if (r->cur) {
    r->cur->next = r->old;
    r->old = r->cur;
  }
  r->cur = a;
  return GS_SUCCESS;
}

typedef struct opening {
  ring_t *r;
  size_t len;
  long at;
  char detail[160];
} opening_t;

/* One try at room for the table (a gs_progress_wait poll): 1 with the
 * ring's lock held and o->at set; 0 with it released. */
static int try_open(void *ctx, gs_status_t *err) {
  opening_t *o = ctx;
  ring_t *r = o->r;
  pthread_mutex_lock(&r->lock);
  gs_status_t s = reclaim(r);
  long at = -1;
  if (s == GS_SUCCESS && r->cur) at = fit(r->cur, o->len);
  if (s == GS_SUCCESS && at < 0 && may_grow(r, o->len)) {
    s = grow(r, o->len);
    at = 0;
  }
  arena_t *a = r->cur;
  if (s == GS_SUCCESS && a->nsegs == a->cap) { /* close then needs no memory */
    size_t cap = a->cap ? 2 * a->cap : 64;
    segment_t *n = realloc(a->segs, cap * sizeof *n);
    if (n) a->segs = n, a->cap = cap;
    else s = gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a kernel table");
  }
  if (s == GS_SUCCESS && at >= 0) {
    o->at = at;
    return 1;
  }
  snprintf(o->detail, sizeof o->detail,
           "the ring (%zu bytes, its bound %zu) is full of tables whose kernels the GPU has "
           "not run yet",
           r->bytes, RING_MAX);
  pthread_mutex_unlock(&r->lock);
  if (s == GS_SUCCESS) return 0;
  *err = s;
  return -1;
}

static const char *opening_detail(void *ctx) { return ((opening_t *)ctx)->detail; }

/* The arena's mirror may be used on `stream` (after its allocation). */
static gs_status_t after_allocation(arena_t *a, void *stream) {
  if (!a->ready) return GS_SUCCESS;
  int done = gs_cu_event_poll(a->ready, "gradsync: a kernel table ring");
  if (done < 0) return GS_ERR_CUDA;
  if (!done) return gs_cu_stream_wait_event(stream, a->ready, "gradsync: a kernel table ring");
  gs_cu_event_free(a->ready); /* seen complete: every later use is ordered after it */
  a->ready = NULL;
  return GS_SUCCESS;
}

gs_status_t gs_cu_table_open(size_t len, void *stream, gs_cu_table_t *t) {
  int device = 0;
  pthread_once(&rings_once, init_rings);
  GS_CHECK(gs_cuda_get_device(&device));
  if (device < 0 || device >= MAX_DEVICES)
    return gs_fail(GS_ERR_UNSUPPORTED, "gradsync: CUDA device %d is beyond the %d supported",
                   device, MAX_DEVICES);
  opening_t o = {&rings[device], (len + ALIGN - 1) / ALIGN * ALIGN, -1, ""};
  gs_wait_t w = {try_open,       NULL, NULL,
                 opening_detail, &o,   "gradsync: waiting for room in the kernel table ring"};
  GS_CHECK(gs_progress_wait(&w)); /* done: the lock is held */
  arena_t *a = o.r->cur;
  gs_status_t s = after_allocation(a, stream);
  if (s != GS_SUCCESS) {
    pthread_mutex_unlock(&o.r->lock);
    return s;
  }
  *t = (gs_cu_table_t){o.r, a, (size_t)o.at, o.len, a->host + o.at, a->dev + o.at, 0};
  return GS_SUCCESS;
}

gs_status_t gs_cu_table_close(gs_cu_table_t *t, void *stream) {
  ring_t *r = t->ring;
  arena_t *a = t->arena;
  void *ev = NULL;
  gs_status_t s = GS_SUCCESS;
  if (t->sent) { /* else nothing reads the region: it stays free */
    s = gs_cu_record(stream, &ev, "gradsync: after a kernel launch");
    /* without an event the region is never reused (the context is lost anyway) */
    a->segs[a->nsegs++] = (segment_t){t->off, t->len, ev};
    a->head = t->off + t->len;
  }
  pthread_mutex_unlock(&r->lock);
  return s;
}

/* ---- result buffers ---------------------------------------------------------- */

struct gs_cu_result {
  char *host;
  size_t bytes;
  void *event; /* behind the copy into it, until seen complete */
  int busy, lost, device;
  struct gs_cu_result *next;
};

static gs_cu_result_t *results;
static pthread_mutex_t results_lock = PTHREAD_MUTEX_INITIALIZER;

/* Whether r may be handed out (under results_lock). */
static int reusable(gs_cu_result_t *r, int device) {
  if (r->busy || r->lost || r->device != device) return 0;
  if (r->event && gs_cu_event_poll(r->event, "gradsync: a result buffer's copy") > 0) {
    gs_cu_event_free(r->event);
    r->event = NULL;
  }
  return !r->event;
}

gs_status_t gs_cu_result_get(size_t bytes, gs_cu_result_t **out) {
  int device = 0;
  GS_CHECK(gs_cuda_get_device(&device));
  pthread_mutex_lock(&results_lock);
  gs_cu_result_t *r = results, *small = NULL;
  for (; r && !(reusable(r, device) && r->bytes >= bytes); r = r->next)
    if (!small && reusable(r, device)) small = r;
  gs_status_t s = GS_SUCCESS;
  if (!r && small) { /* idle and too small: replaced by a larger one */
    gs_cu_release(small->host);
    small->host = NULL;
    small->bytes = 0;
    s = gs_cu_grow_pinned((void **)&small->host, &small->bytes, bytes, NULL);
    r = small;
  } else if (!r) {
    r = calloc(1, sizeof *r);
    if (!r) s = gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a result buffer");
    else s = gs_cu_grow_pinned((void **)&r->host, &r->bytes, bytes, NULL);
    if (r) r->device = device, r->next = results, results = r;
  }
  if (s == GS_SUCCESS) r->busy = 1;
  pthread_mutex_unlock(&results_lock);
  *out = s == GS_SUCCESS ? r : NULL;
  return s;
}

gs_status_t gs_cu_result_fetch(gs_cu_result_t *r, const void *src, size_t bytes, void *stream) {
  GS_CHECK(gs_cu_copy(r->host, src, bytes, stream));
  gs_status_t s = gs_cu_record(stream, &r->event, "gradsync: after a result's copy");
  r->lost = s != GS_SUCCESS; /* a copy no event follows: never reused */
  return s;
}

gs_status_t gs_cu_result_upload(gs_cu_result_t *r, void *dst, const void *src, size_t bytes,
                                void *stream) {
  memcpy(r->host, src, bytes); /* no copy is pending: it was handed out */
  GS_CHECK(gs_cu_copy(dst, r->host, bytes, stream));
  gs_status_t s = gs_cu_record(stream, &r->event, "gradsync: after an upload's copy");
  r->lost = s != GS_SUCCESS;
  return s;
}

gs_status_t gs_cu_result_read(gs_cu_result_t *r, void *out, size_t bytes, const char *what) {
  gs_status_t s = gs_cu_event_wait(r->event, what);
  if (s == GS_SUCCESS) {
    if (bytes) memcpy(out, r->host, bytes);
    gs_cu_event_free(r->event);
    r->event = NULL;
  }
  gs_cu_result_put(r);
  return s;
}

void gs_cu_result_put(gs_cu_result_t *r) {
  if (!r) return;
  pthread_mutex_lock(&results_lock);
  r->busy = 0; /* a copy still pending keeps its event: reusable once it completes */
  pthread_mutex_unlock(&results_lock);
}

#endif
