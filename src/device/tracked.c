/* Memory that keeps a record of the streams using it (gs_mem_t,
 * gs_device.h): gradsync.DeviceArray's memory. CUDA memory is allocated on
 * gradsync's memory stream of its device, which exists as long as the
 * process, never on a caller's stream (a torch or CuPy side stream may be
 * destroyed while the memory lives on). Each use records an event on the
 * stream that used it, at the time of the use: a "mark". A mark is shared by
 * the memories of one call and counted. A memory keeps its latest mark per
 * stream (streams named by cudaStreamGetId, since a destroyed stream's handle
 * may come back for a new one) and the mark of its last write ("ready").
 * Marks whose work has finished are dropped as they are found. Freeing makes
 * the memory stream wait for every mark still pending, then frees in its
 * order: no host wait, and no stream touched but gradsync's own. */
#include <pthread.h>
#include <stdlib.h>

#include "device/gs_cuda.h"

typedef struct mark {
  void *event;            /* pooled (gs_cu_record) */
  unsigned long long key; /* its stream (gs_cu_stream_key) */
  int refs;               /* memories holding it, ready or use (atomic) */
} mark_t;

struct gs_mem {
  gs_device_t device;
  void *ptr;
  pthread_mutex_t lock;
  mark_t *ready; /* the last write (one reference) */
  mark_t **uses; /* the latest use per stream (one reference each) */
  int nuses, cap;
};

static void mark_release(mark_t *m) {
  if (m && __atomic_sub_fetch(&m->refs, 1, __ATOMIC_ACQ_REL) == 0) {
    gs_cu_event_free(m->event);
    free(m);
  }
}

static mark_t *mark_hold(mark_t *m) {
  __atomic_add_fetch(&m->refs, 1, __ATOMIC_ACQ_REL);
  return m;
}

/* A mark of the work queued on `stream` so far (no reference held yet). */
static gs_status_t mark_new(void *stream, mark_t **out) {
  mark_t *m = calloc(1, sizeof *m);
  if (!m) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory recording a stream's use");
  gs_status_t s = gs_cu_stream_key(stream, &m->key);
  if (s == GS_SUCCESS) s = gs_cu_record(stream, &m->event, "gradsync: recording a stream's use");
  if (s != GS_SUCCESS) {
    free(m);
    return s;
  }
  *out = m;
  return GS_SUCCESS;
}

/* Drops the marks whose work has finished (under the lock; device entered).
 * A CUDA error keeps the mark: a later wait reports it. */
static void prune(struct gs_mem *m) {
  int k = 0;
  for (int i = 0; i < m->nuses; i++) {
    if (gs_cu_event_poll(m->uses[i]->event, "gradsync: a stream's use of memory") == 1) {
      mark_release(m->uses[i]);
      continue;
    }
    m->uses[k++] = m->uses[i];
  }
  m->nuses = k;
  gs_clear_error();
  if (m->ready && gs_cu_event_poll(m->ready->event, "gradsync: a write to memory") == 1) {
    mark_release(m->ready);
    m->ready = NULL;
  }
  gs_clear_error();
}

/* The memory's use on mark's stream is now `mark`. */
static gs_status_t attach(struct gs_mem *m, mark_t *mark, int writes) {
  int i = 0;
  while (i < m->nuses && m->uses[i]->key != mark->key) i++;
  if (i == m->nuses && m->nuses == m->cap) {
    int cap = m->cap ? 2 * m->cap : 4;
    mark_t **u = realloc(m->uses, (size_t)cap * sizeof *u);
    if (!u) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory recording a stream's use");
    m->uses = u;
    m->cap = cap;
  }
  if (i < m->nuses) mark_release(m->uses[i]);
  else m->nuses++;
  m->uses[i] = mark_hold(mark);
  if (writes) {
    mark_release(m->ready);
    m->ready = mark_hold(mark);
  }
  return GS_SUCCESS;
}

static void release_all(struct gs_mem *m) {
  for (int i = 0; i < m->nuses; i++) mark_release(m->uses[i]);
  m->nuses = 0;
  mark_release(m->ready);
  m->ready = NULL;
}

gs_status_t gs_mem_alloc(gs_device_t device, size_t bytes, gs_mem_t *mem) {
  gs_clear_error();
  if (!mem) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_mem_alloc: mem is NULL");
  *mem = NULL;
  struct gs_mem *m = calloc(1, sizeof *m);
  if (!m) return gs_fail(GS_ERR_NO_MEMORY, "gs_mem_alloc: out of memory");
  m->device = device;
  pthread_mutex_init(&m->lock, NULL);
  gs_status_t s;
  if (device.kind != GS_DEVICE_CUDA) {
    s = gs_malloc(device, bytes, &m->ptr);
  } else {
    gs_cu_scope_t scope;
    void *stream = NULL;
    mark_t *born = NULL;
    s = gs_cu_enter(device.id, &scope);
    if (s == GS_SUCCESS) {
      s = gs_cu_memory_stream(device.id, &stream);
      if (s == GS_SUCCESS)
        s = gs_cu_malloc_async(&m->ptr, bytes, stream, "DeviceArray (CUDA device memory)");
      if (s == GS_SUCCESS) s = mark_new(stream, &born); /* ready once allocated */
      if (s == GS_SUCCESS) s = attach(m, born, 1);
      if (s != GS_SUCCESS && m->ptr) gs_cu_free_async(m->ptr, stream);
      gs_cu_leave(&scope);
    }
    if (born && !born->refs) mark_release(mark_hold(born));
  }
  if (s != GS_SUCCESS) {
    release_all(m);
    free(m->uses);
    pthread_mutex_destroy(&m->lock);
    free(m);
    return s;
  }
  *mem = m;
  return GS_SUCCESS;
}

void *gs_mem_ptr(gs_mem_t mem) { return mem ? mem->ptr : NULL; }

/* The marks a waiter must wait for (writes: every use; else the last
 * write), held, in a new array *w; returns how many, or -1 out of memory.
 * Under the lock. */
static int to_wait(struct gs_mem *m, int writes, mark_t ***w) {
  prune(m);
  int n = writes ? m->nuses : m->ready != NULL;
  *w = n ? malloc((size_t)n * sizeof **w) : NULL;
  if (n && !*w) return -1;
  for (int i = 0; i < n; i++) (*w)[i] = mark_hold(writes ? m->uses[i] : m->ready);
  return n;
}

/* Waits for the marks (stream NULL: on the host) and releases them. */
static gs_status_t wait_marks(void *stream, mark_t **w, int n) {
  gs_status_t s = GS_SUCCESS;
  for (int i = 0; i < n; i++) {
    if (s == GS_SUCCESS)
      s = stream ? gs_cu_stream_wait_event(stream, w[i]->event, "gradsync: ordering after a use")
                 : gs_cu_event_wait(w[i]->event, "gradsync: waiting for a write to memory");
    mark_release(w[i]);
  }
  free(w);
  return s;
}

/* The device of the first CUDA memory that has recorded uses, or -1 (host
 * memory, or nothing recorded: no context to enter, the quick way out of
 * the latency-bound calls). */
static int first_cuda(const gs_mem_t *mems, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    struct gs_mem *m = mems[i];
    if (!m || m->device.kind != GS_DEVICE_CUDA) continue;
    pthread_mutex_lock(&m->lock);
    int recorded = m->nuses > 0 || m->ready;
    pthread_mutex_unlock(&m->lock);
    if (recorded) return m->device.id;
  }
  return -1;
}

gs_status_t gs_mem_order(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes) {
  gs_clear_error();
  int device = mems ? first_cuda(mems, n) : -1;
  if (device < 0) return GS_SUCCESS; /* host memory: no stream order */
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  void *on = stream ? gs_cu_as_stream(stream) : NULL;
  gs_status_t s = GS_SUCCESS;
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    struct gs_mem *m = mems[i];
    if (!m || m->device.kind != GS_DEVICE_CUDA || m->device.id != device) continue;
    mark_t **w = NULL;
    pthread_mutex_lock(&m->lock); /* held marks: the host waits unlocked */
    int k = to_wait(m, writes, &w);
    pthread_mutex_unlock(&m->lock);
    s = k < 0 ? gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory ordering after a use")
              : wait_marks(on, w, k);
  }
  gs_cu_leave(&scope);
  return s;
}

gs_status_t gs_mem_use(const gs_mem_t *mems, int64_t n, uintptr_t stream, int writes) {
  gs_clear_error();
  int device = -1;
  for (int64_t i = 0; mems && i < n && device < 0; i++)
    if (mems[i] && mems[i]->device.kind == GS_DEVICE_CUDA) device = mems[i]->device.id;
  if (device < 0) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  mark_t *mark = NULL;
  gs_status_t s = mark_new(gs_cu_as_stream(stream), &mark);
  if (s == GS_SUCCESS) mark_hold(mark); /* ours until attached everywhere */
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    struct gs_mem *m = mems[i];
    if (!m || m->device.kind != GS_DEVICE_CUDA || m->device.id != device) continue;
    pthread_mutex_lock(&m->lock);
    prune(m);
    s = attach(m, mark, writes);
    pthread_mutex_unlock(&m->lock);
  }
  mark_release(mark);
  gs_cu_leave(&scope);
  return s;
}

gs_status_t gs_mem_stream(gs_mem_t mem, uintptr_t *stream) {
  gs_clear_error();
  if (!stream) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_mem_stream: stream is NULL");
  *stream = 0;
  if (!mem || mem->device.kind != GS_DEVICE_CUDA) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(mem->device.id, &scope));
  void *ours = NULL;
  gs_status_t s = gs_cu_memory_stream(mem->device.id, &ours);
  pthread_mutex_lock(&mem->lock);
  if (s == GS_SUCCESS) prune(mem);
  for (int i = 0; i < mem->nuses && s == GS_SUCCESS; i++)
    s = gs_cu_stream_wait_event(ours, mem->uses[i]->event, "gradsync: exporting memory");
  if (s == GS_SUCCESS && mem->nuses > 0) *stream = (uintptr_t)ours;
  pthread_mutex_unlock(&mem->lock);
  gs_cu_leave(&scope);
  return s;
}

/* CUDA memory: the memory stream waits for every pending use, then frees. */
static gs_status_t free_cuda(struct gs_mem *m) {
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(m->device.id, &scope));
  void *ours = NULL;
  gs_status_t s = gs_cu_memory_stream(m->device.id, &ours);
  if (s == GS_SUCCESS) prune(m);
  for (int i = 0; i < m->nuses && s == GS_SUCCESS; i++)
    s = gs_cu_stream_wait_event(ours, m->uses[i]->event, "gradsync: freeing memory");
  /* after an error nothing can be ordered: the memory is left, not freed early */
  if (s == GS_SUCCESS) gs_cu_free_async(m->ptr, ours);
  gs_cu_leave(&scope);
  return s;
}

gs_status_t gs_mem_free(gs_mem_t *mem) {
  gs_clear_error();
  if (!mem || !*mem) return GS_SUCCESS;
  struct gs_mem *m = *mem;
  *mem = NULL;
  gs_status_t s = m->device.kind == GS_DEVICE_CUDA ? free_cuda(m) : gs_free(m->device, m->ptr);
  release_all(m);
  free(m->uses);
  pthread_mutex_destroy(&m->lock);
  free(m);
  return s;
}
