/* Emulated CUDA: streams, events and the sticky error (see emu.h). Every
 * stream owns a thread that runs its operations in order, each after the
 * operations it depends on (earlier work on its own stream, stream waits on
 * events, and the legacy default stream's implicit ordering). Each
 * operation also carries the vector clock of what it is ordered after, for
 * the race checks (emu_races.c). One lock and one condition variable cover
 * all of it: this is a test harness, made to be simple and strict, not
 * fast. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"

#define HOOK __attribute__((visibility("default")))

#define MAX_DEVICES 8
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u

/* A vector clock: for each stream (by index), the last operation of it
 * that an operation is ordered after. */
typedef struct clock {
  uint64_t *vc;
  int n;
} clock_t_;

typedef struct dep {
  emu_stream_t *s;
  uint64_t seq;
  const clock_t_ *clock; /* the clock at that point (an event's) */
} dep_t;

typedef struct op {
  struct op *next;
  uint64_t seq;
  emu_fn fn; /* NULL: an ordering point only */
  void *arg;
  int ndeps;
  dep_t *deps;
  clock_t_ clock;
} op_t;

struct emu_stream {
  unsigned magic;
  int device;
  int legacy;        /* the legacy default stream of `device` */
  int nonblocking;   /* cudaStreamNonBlocking: no implicit legacy ordering */
  int idx;           /* its index in the clocks */
  int destroyed;     /* cudaStreamDestroy'd: its work runs, its handle is dead */
  op_t *head, *tail;
  uint64_t enqueued, completed;
  clock_t_ clock;    /* of its latest enqueued operation */
  emu_stream_t *next_all;
};

typedef struct emu_event {
  unsigned magic;
  emu_stream_t *s;
  uint64_t seq;
  clock_t_ clock;
} emu_event_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static emu_stream_t *all_streams;
static emu_stream_t *legacy_streams[MAX_DEVICES];
static cudaError_t sticky_error = cudaSuccess;
static long delay_us = -1;
static int nstreams;
static long destroyed_uses;
static _Thread_local const op_t *running; /* on a stream's thread, while it runs */
static _Thread_local int running_stream;

cudaError_t emu_sticky(void) {
  pthread_mutex_lock(&mu);
  cudaError_t e = sticky_error;
  pthread_mutex_unlock(&mu);
  return e;
}

static long op_delay(void) {
  if (delay_us < 0) {
    const char *s = getenv("GS_EMU_DELAY_US");
    delay_us = s && *s ? atol(s) : 100;
  }
  return delay_us;
}

static int deps_done(const op_t *o) {
  for (int k = 0; k < o->ndeps; k++)
    if (o->deps[k].s->completed < o->deps[k].seq) return 0;
  return 1;
}

static void *stream_thread(void *arg) {
  emu_stream_t *s = arg;
  pthread_mutex_lock(&mu);
  for (;;) {
    while ((!s->head && !s->destroyed) || (s->head && !deps_done(s->head)))
      pthread_cond_wait(&progress, &mu);
    if (!s->head) break; /* destroyed, and its work done */
    op_t *o = s->head;
    cudaError_t before = sticky_error;
    running = o;
    running_stream = s->idx;
    pthread_mutex_unlock(&mu);
    long d = op_delay();
    if (d > 0 && o->fn) {
      struct timespec t = {d / 1000000, (d % 1000000) * 1000};
      nanosleep(&t, NULL);
    }
    /* after a sticky error nothing runs, but everything completes, so no
     * wait on the host hangs: it sees the error instead */
    cudaError_t e = (o->fn && before == cudaSuccess) ? o->fn(o->arg) : cudaSuccess;
    pthread_mutex_lock(&mu);
    running = NULL;
    if (e != cudaSuccess && sticky_error == cudaSuccess) sticky_error = e;
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->completed = o->seq;
    pthread_cond_broadcast(&progress);
    free(o->arg);
    free(o->deps);
    free(o->clock.vc);
    free(o);
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

static emu_stream_t *new_stream(int device, int legacy, int nonblocking) {
  emu_stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->magic = STREAM_MAGIC;
  s->device = device;
  s->legacy = legacy;
  s->nonblocking = nonblocking;
  s->idx = nstreams++;
  pthread_t th;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int e = pthread_create(&th, &attr, stream_thread, s);
  pthread_attr_destroy(&attr);
  if (e != 0) {
    free(s);
    return NULL;
  }
  s->next_all = all_streams; /* streams live as long as the process */
  all_streams = s;
  return s;
}

/* The emulated stream behind a handle, under the lock. NULL and
 * cudaStreamLegacy (and, approximated, cudaStreamPerThread) are the current
 * device's legacy default stream. A destroyed stream's handle is dead: its
 * use is counted and reported, and resolves to nothing. */
static emu_stream_t *resolve(cudaStream_t h, int device) {
  if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    if (!legacy_streams[device]) legacy_streams[device] = new_stream(device, 1, 0);
    return legacy_streams[device];
  }
  emu_stream_t *s = (emu_stream_t *)h;
  if (s->magic != STREAM_MAGIC) return NULL;
  if (s->destroyed) {
    destroyed_uses++;
    fprintf(stderr, "emulated CUDA: use of stream %p after cudaStreamDestroy\n", (void *)s);
    return NULL;
  }
  return s;
}

/* ---- vector clocks ---------------------------------------------------------------- */

/* Raises c to at least `other`, entry by entry (growing it as needed). */
static int clock_join(clock_t_ *c, const uint64_t *other, int n) {
  if (n > c->n) {
    uint64_t *g = realloc(c->vc, (size_t)n * sizeof *g);
    if (!g) return -1;
    memset(g + c->n, 0, (size_t)(n - c->n) * sizeof *g);
    c->vc = g;
    c->n = n;
  }
  for (int i = 0; i < n; i++)
    if (other[i] > c->vc[i]) c->vc[i] = other[i];
  return 0;
}

static int clock_copy(clock_t_ *to, const clock_t_ *from) {
  free(to->vc);
  to->vc = NULL;
  to->n = 0;
  return clock_join(to, from->vc, from->n);
}

/* The clock of operation `seq` of s, queued now after `deps`: its stream's
 * earlier work, its dependencies' clocks, and everything already finished
 * (the host may have waited for it, so nothing queued now runs before it). */
static int clock_of(clock_t_ *c, emu_stream_t *s, const dep_t *deps, int ndeps, uint64_t seq) {
  uint64_t *done = calloc((size_t)nstreams, sizeof *done);
  if (!done) return -1;
  for (emu_stream_t *t = all_streams; t; t = t->next_all) done[t->idx] = t->completed;
  int e = clock_join(c, done, nstreams);
  free(done);
  if (e == 0) e = clock_join(c, s->clock.vc, s->clock.n);
  for (int k = 0; k < ndeps && e == 0; k++)
    e = deps[k].clock ? clock_join(c, deps[k].clock->vc, deps[k].clock->n)
                      : clock_join(c, deps[k].s->clock.vc, deps[k].s->clock.n);
  if (e == 0) c->vc[s->idx] = seq;
  return e == 0 ? clock_copy(&s->clock, c) : -1;
}

/* Appends an operation; `extra` is one more dependency (a stream wait). */
static cudaError_t push(emu_stream_t *s, emu_fn fn, void *arg, const dep_t *extra, uint64_t *seq) {
  op_t *o = calloc(1, sizeof *o);
  int cap = 2;
  for (emu_stream_t *t = all_streams; t; t = t->next_all) cap++;
  o->deps = o ? calloc((size_t)cap, sizeof *o->deps) : NULL;
  if (!o || !o->deps) {
    if (o) free(o);
    return cudaErrorMemoryAllocation;
  }
  if (extra && extra->s) o->deps[o->ndeps++] = *extra;
  if (!s->nonblocking) {
    /* the legacy stream waits for blocking streams' earlier work, and
     * blocking streams wait for the legacy stream's */
    for (emu_stream_t *t = all_streams; t; t = t->next_all)
      if (t != s && t->device == s->device && !t->nonblocking && (s->legacy || t->legacy) &&
          t->enqueued > t->completed)
        o->deps[o->ndeps++] = (dep_t){t, t->enqueued, NULL};
  }
  if (clock_of(&o->clock, s, o->deps, o->ndeps, s->enqueued + 1) != 0) {
    free(o->clock.vc);
    free(o->deps);
    free(o);
    return cudaErrorMemoryAllocation;
  }
  o->fn = fn;
  o->arg = arg;
  o->seq = ++s->enqueued;
  if (s->tail) s->tail->next = o;
  else s->head = o;
  s->tail = o;
  if (seq) *seq = o->seq;
  pthread_cond_broadcast(&progress);
  return cudaSuccess;
}

cudaError_t emu_enqueue(cudaStream_t stream, emu_fn fn, const void *arg, size_t arg_bytes) {
  int device = emu_current_device();
  if (device < 0) return emu_sticky();
  void *copy = malloc(arg_bytes ? arg_bytes : 1);
  if (!copy) return cudaErrorMemoryAllocation;
  if (arg_bytes) memcpy(copy, arg, arg_bytes);
  pthread_mutex_lock(&mu);
  cudaError_t e = sticky_error;
  emu_stream_t *s = e == cudaSuccess ? resolve(stream, device) : NULL;
  if (e == cudaSuccess && !s) e = cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) e = push(s, fn, copy, NULL, NULL);
  pthread_mutex_unlock(&mu);
  if (e != cudaSuccess) free(copy);
  return e;
}

/* ---- the runtime's stream and event functions ----------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned int flags) {
  int device = emu_current_device();
  if (device < 0) return emu_sticky();
  pthread_mutex_lock(&mu);
  emu_stream_t *s = new_stream(device, 0, (flags & cudaStreamNonBlocking) != 0);
  pthread_mutex_unlock(&mu);
  if (!s) return cudaErrorMemoryAllocation;
  *out = (cudaStream_t)s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *out) { return cudaStreamCreateWithFlags(out, 0); }

static cudaError_t lock_stream(cudaStream_t h, emu_stream_t **s);

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  /* its work still runs; the emulated stream stays (a test harness), but
   * its handle is dead from now on */
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  cudaError_t e = s && !s->legacy ? cudaSuccess : cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) s->destroyed = 1;
  pthread_cond_broadcast(&progress); /* its thread ends once its work has */
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaStreamGetId(cudaStream_t h, unsigned long long *id) {
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  if (s) *id = (unsigned long long)s->idx + 1;
  pthread_mutex_unlock(&mu);
  return s ? cudaSuccess : cudaErrorInvalidResourceHandle;
}

cudaError_t cudaStreamGetDevice(cudaStream_t h, int *device) {
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  if (s) *device = s->device;
  pthread_mutex_unlock(&mu);
  return s ? cudaSuccess : cudaErrorInvalidResourceHandle;
}

/* ---- what the race checks ask (emu.h) ------------------------------------------- */

int emu_running_clock(emu_clock_t *c) {
  const op_t *o = running;
  if (!o) return 0;
  c->self = (emu_point_t){running_stream, o->seq};
  c->vc = o->clock.vc;
  c->n = o->clock.n;
  return 1;
}

cudaError_t emu_mark(cudaStream_t h, emu_point_t *at) {
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  uint64_t seq = 0;
  cudaError_t e = s ? push(s, NULL, NULL, NULL, &seq) : cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) *at = (emu_point_t){s->idx, seq};
  pthread_mutex_unlock(&mu);
  return e;
}

static cudaError_t wait_until(emu_stream_t *s, uint64_t seq) {
  while (s->completed < seq) pthread_cond_wait(&progress, &mu);
  return sticky_error;
}

/* The calling thread's device's stream `h`, with `mu` held: on success the
 * caller unlocks; *s is NULL for a handle of no stream. Without a device:
 * the sticky error, nothing locked. */
static cudaError_t lock_stream(cudaStream_t h, emu_stream_t **s) {
  int device = emu_current_device();
  if (device < 0) return emu_sticky();
  pthread_mutex_lock(&mu);
  *s = resolve(h, device);
  return cudaSuccess;
}

/* Calls that wait for device work on the host without bound (no timeout
 * can end them): made while any stream of the device has work queued, an
 * NCCL kernel there waiting for a peer that waits for this host hangs them. */
static long blocking_calls;

void emu_blocking_call(const char *fn) {
  int device = emu_current_device();
  if (device < 0) return;
  int busy = 0;
  pthread_mutex_lock(&mu);
  for (emu_stream_t *s = all_streams; s && !busy; s = s->next_all)
    busy = s->device == device && s->completed < s->enqueued;
  pthread_mutex_unlock(&mu);
  if (busy && __atomic_add_fetch(&blocking_calls, 1, __ATOMIC_SEQ_CST) <= 5)
    fprintf(stderr, "emulated CUDA: %s while device %d has work queued: it waits for the "
            "device without bound (no timeout ends it)\n", fn, device);
}

long emu_blocking_calls(void) { return __atomic_load_n(&blocking_calls, __ATOMIC_SEQ_CST); }

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  emu_blocking_call("cudaStreamSynchronize");
  return emu_stream_sync(h);
}

cudaError_t emu_stream_sync(cudaStream_t h) {
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  uint64_t seq = 0;
  cudaError_t e = s ? push(s, NULL, NULL, NULL, &seq) : cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) e = wait_until(s, seq);
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
  emu_stream_t *s;
  cudaError_t locked = lock_stream(h, &s);
  if (locked != cudaSuccess) return locked;
  cudaError_t e = !s                            ? cudaErrorInvalidResourceHandle
                  : sticky_error != cudaSuccess ? sticky_error
                  : s->completed < s->enqueued  ? cudaErrorNotReady
                                                : cudaSuccess;
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaDeviceSynchronize(void) {
  emu_blocking_call("cudaDeviceSynchronize");
  int device = emu_current_device();
  if (device < 0) return emu_sticky();
  pthread_mutex_lock(&mu);
  for (emu_stream_t *s = all_streams; s; s = s->next_all)
    if (s->device == device) wait_until(s, s->enqueued);
  cudaError_t e = sticky_error;
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned int flags) {
  (void)flags;
  if (emu_current_device() < 0) return emu_sticky();
  emu_event_t *ev = calloc(1, sizeof *ev);
  if (!ev) return cudaErrorMemoryAllocation;
  ev->magic = EVENT_MAGIC;
  *out = (cudaEvent_t)ev;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *out) { return cudaEventCreateWithFlags(out, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t h) {
  emu_event_t *ev = (emu_event_t *)h;
  if (!ev || ev->magic != EVENT_MAGIC) return cudaErrorInvalidResourceHandle;
  ev->magic = 0;
  free(ev->clock.vc);
  free(ev);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t stream) {
  emu_event_t *ev = (emu_event_t *)h;
  if (!ev || ev->magic != EVENT_MAGIC) return cudaErrorInvalidResourceHandle;
  emu_stream_t *s;
  cudaError_t locked = lock_stream(stream, &s);
  if (locked != cudaSuccess) return locked;
  uint64_t seq = 0;
  /* a marker operation: on the legacy stream it also covers the blocking
   * streams' earlier work, as recording there does */
  cudaError_t e = s ? push(s, NULL, NULL, NULL, &seq) : cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) {
    ev->s = s;
    ev->seq = seq;
    if (clock_copy(&ev->clock, &s->clock) != 0) e = cudaErrorMemoryAllocation;
  }
  pthread_mutex_unlock(&mu);
  return e;
}

static long event_queries; /* cudaEventQuery calls: a test sees a thread polling */

cudaError_t cudaEventQuery(cudaEvent_t h) {
  emu_event_t *ev = (emu_event_t *)h;
  if (!ev || ev->magic != EVENT_MAGIC) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&mu);
  event_queries++;
  cudaError_t e = sticky_error != cudaSuccess           ? sticky_error
                  : ev->s && ev->s->completed < ev->seq ? cudaErrorNotReady
                                                        : cudaSuccess;
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
  emu_event_t *ev = (emu_event_t *)h;
  if (!ev || ev->magic != EVENT_MAGIC) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&mu);
  cudaError_t e = ev->s ? wait_until(ev->s, ev->seq) : sticky_error;
  pthread_mutex_unlock(&mu);
  return e;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t h, unsigned int flags) {
  (void)flags;
  emu_event_t *ev = (emu_event_t *)h;
  if (!ev || ev->magic != EVENT_MAGIC) return cudaErrorInvalidResourceHandle;
  emu_stream_t *s;
  cudaError_t locked = lock_stream(stream, &s);
  if (locked != cudaSuccess) return locked;
  dep_t dep = {ev->s, ev->seq, &ev->clock};
  cudaError_t e = s ? push(s, NULL, NULL, &dep, NULL) : cudaErrorInvalidResourceHandle;
  pthread_mutex_unlock(&mu);
  return e;
}

long emu_destroyed_uses(void) {
  pthread_mutex_lock(&mu);
  long n = destroyed_uses;
  pthread_mutex_unlock(&mu);
  return n;
}

/* cudaEventQuery calls so far: a count that keeps growing while another
 * thread is inside a polling wait. */
HOOK long gs_emulated_event_queries(void) {
  pthread_mutex_lock(&mu);
  long n = event_queries;
  pthread_mutex_unlock(&mu);
  return n;
}

/* Operations queued on `stream` so far (copies, kernels, event records,
 * stream waits): lets a test see that another thread's call has queued its
 * work before it goes on. */
HOOK long gs_emulated_queued(uintptr_t stream) {
  emu_stream_t *s;
  cudaStream_t h = stream == 1 ? cudaStreamLegacy : stream == 2 ? cudaStreamPerThread
                                                               : (cudaStream_t)stream;
  if (lock_stream(h, &s) != cudaSuccess) return -1;
  long n = s ? (long)s->enqueued : -1;
  pthread_mutex_unlock(&mu);
  return n;
}

