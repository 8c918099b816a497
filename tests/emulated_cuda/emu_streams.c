/* Emulated CUDA: streams, events and the sticky error (see emu.h). Every
 * stream owns a thread that runs its operations in order, each after the
 * operations it depends on (earlier work on its own stream, stream waits on
 * events, and the legacy default stream's implicit ordering). One lock and
 * one condition variable cover all of it: this is a test harness, made to
 * be simple and strict, not fast. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"

#define MAX_DEVICES 8
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u

typedef struct dep {
  emu_stream_t *s;
  uint64_t seq;
} dep_t;

typedef struct op {
  struct op *next;
  uint64_t seq;
  emu_fn fn; /* NULL: an ordering point only */
  void *arg;
  int ndeps;
  dep_t *deps;
} op_t;

struct emu_stream {
  unsigned magic;
  int device;
  int legacy;        /* the legacy default stream of `device` */
  int nonblocking;   /* cudaStreamNonBlocking: no implicit legacy ordering */
  int destroyed;     /* cudaStreamDestroy: its thread ends once its work has */
  op_t *head, *tail;
  uint64_t enqueued, completed;
  emu_stream_t *next_all;
};

typedef struct emu_event {
  unsigned magic;
  emu_stream_t *s;
  uint64_t seq;
} emu_event_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static emu_stream_t *all_streams;
static emu_stream_t *legacy_streams[MAX_DEVICES];
static cudaError_t sticky_error = cudaSuccess;
static long delay_us = -1;

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
    if (e != cudaSuccess && sticky_error == cudaSuccess) sticky_error = e;
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->completed = o->seq;
    pthread_cond_broadcast(&progress);
    free(o->arg);
    free(o->deps);
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
 * device's legacy default stream. */
static emu_stream_t *resolve(cudaStream_t h, int device) {
  if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    if (!legacy_streams[device]) legacy_streams[device] = new_stream(device, 1, 0);
    return legacy_streams[device];
  }
  emu_stream_t *s = (emu_stream_t *)h;
  return s->magic == STREAM_MAGIC && !s->destroyed ? s : NULL;
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
        o->deps[o->ndeps++] = (dep_t){t, t->enqueued};
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

/* Its queued work still runs, then its thread ends; the struct stays (events
 * and other streams' dependencies may still name it), and any later use of
 * the handle fails. */
cudaError_t cudaStreamDestroy(cudaStream_t h) {
  emu_stream_t *s = (emu_stream_t *)h;
  if (!s || h == cudaStreamLegacy || h == cudaStreamPerThread) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&mu);
  cudaError_t e = s->magic == STREAM_MAGIC && !s->destroyed && !s->legacy
                      ? cudaSuccess : cudaErrorInvalidResourceHandle;
  if (e == cudaSuccess) s->destroyed = 1;
  pthread_cond_broadcast(&progress);
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

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
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
  dep_t dep = {ev->s, ev->seq};
  cudaError_t e = s ? push(s, NULL, NULL, &dep, NULL) : cudaErrorInvalidResourceHandle;
  pthread_mutex_unlock(&mu);
  return e;
}

/* ---- test hooks (exported; tests find them with dlsym and skip on hardware) ---------- */

#define HOOK __attribute__((visibility("default")))

static cudaStream_t as_handle(uintptr_t s) {
  return s == 0 || s == 1 ? cudaStreamLegacy : s == 2 ? cudaStreamPerThread : (cudaStream_t)s;
}

static cudaError_t sleep_op(void *arg) {
  double seconds = *(double *)arg;
  struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&t, NULL);
  return cudaSuccess;
}

static cudaError_t fault_op(void *arg) { return *(cudaError_t *)arg; }

/* Queues `seconds` of device work on `stream` (of the current device). */
HOOK int gs_emulated_sleep(uintptr_t stream, double seconds) {
  return emu_enqueue(as_handle(stream), sleep_op, &seconds, sizeof seconds);
}

/* A gate: device work that lasts until gs_emulated_release (or 30 s, so a
 * test whose host waits behind a gate fails its check instead of hanging).
 * Tests that ask "is the stream still busy?" hold it with a gate rather than
 * a sleep, which a loaded machine could outlast. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_opened = PTHREAD_COND_INITIALIZER;
static unsigned long gate_generation; /* bumped by each release */
static unsigned long gates_passed;    /* gates whose stream went on past them */

static cudaError_t gate_op(void *arg) {
  unsigned long closed_in = *(unsigned long *)arg;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 30;
  pthread_mutex_lock(&gate_mu);
  int r = 0;
  while (gate_generation == closed_in && r == 0)
    r = pthread_cond_timedwait(&gate_opened, &gate_mu, &until);
  gates_passed++;
  pthread_mutex_unlock(&gate_mu);
  return cudaSuccess;
}

/* Queues a closed gate on `stream`: it stays busy until the next release. */
HOOK int gs_emulated_hold(uintptr_t stream) {
  pthread_mutex_lock(&gate_mu);
  unsigned long generation = gate_generation;
  pthread_mutex_unlock(&gate_mu);
  return emu_enqueue(as_handle(stream), gate_op, &generation, sizeof generation);
}

/* Opens every gate queued so far. */
HOOK void gs_emulated_release(void) {
  pthread_mutex_lock(&gate_mu);
  gate_generation++;
  pthread_cond_broadcast(&gate_opened);
  pthread_mutex_unlock(&gate_mu);
}

/* cudaEventQuery calls so far: a count that keeps growing while another
 * thread is inside a polling wait. */
HOOK long gs_emulated_event_queries(void) {
  pthread_mutex_lock(&mu);
  long n = event_queries;
  pthread_mutex_unlock(&mu);
  return n;
}

/* Gates passed so far (opened, or past their 30 s): a test that finds the
 * count unchanged knows the work behind its gate has not run yet, however
 * much else it queued behind it. */
HOOK long gs_emulated_gates_passed(void) {
  pthread_mutex_lock(&gate_mu);
  long n = (long)gates_passed;
  pthread_mutex_unlock(&gate_mu);
  return n;
}

/* Queues work that fails with `error` (a sticky one loses the context). */
HOOK int gs_emulated_fault(uintptr_t stream, int error) {
  cudaError_t e = (cudaError_t)error;
  return emu_enqueue(as_handle(stream), fault_op, &e, sizeof e);
}

/* 1 while `stream` has work queued or running. */
HOOK int gs_emulated_busy(uintptr_t stream) {
  return cudaStreamQuery(as_handle(stream)) == cudaErrorNotReady;
}

/* Operations queued on `stream` so far (copies, kernels, event records,
 * stream waits): lets a test see that another thread's call has queued its
 * work before it goes on. */
HOOK long gs_emulated_queued(uintptr_t stream) {
  emu_stream_t *s;
  if (lock_stream(as_handle(stream), &s) != cudaSuccess) return -1;
  long n = s ? (long)s->enqueued : -1;
  pthread_mutex_unlock(&mu);
  return n;
}

/* A stream of the test's own on the current device (non-blocking: the
 * legacy default stream does not wait for it), as a caller's CAI stream. */
HOOK uintptr_t gs_emulated_stream(int nonblocking) {
  cudaStream_t s = NULL;
  if (cudaStreamCreateWithFlags(&s, nonblocking ? cudaStreamNonBlocking : 0) != cudaSuccess)
    return 0;
  return (uintptr_t)s;
}

/* Waits on the host for `stream`. */
HOOK int gs_emulated_sync(uintptr_t stream) { return cudaStreamSynchronize(as_handle(stream)); }
