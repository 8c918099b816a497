/* The queue: one background thread runs queued jobs (asynchronous
 * collectives, each through its blocking entry point, so an asynchronous
 * call behaves exactly like the blocking one, only later) in issue order,
 * and requests track them to completion, device work included.
 *
 * Why one thread for the whole process: MPI calls then come from one thread
 * at a time (the worker while requests are pending, the caller otherwise,
 * because every blocking collective drains the queue first), which
 * MPI_THREAD_SERIALIZED allows; and issue order is the order the ranks agree
 * on, which a thread per communicator could not keep across communicators. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/gs_flight_ring.h"
#include "engine/gs_queue.h"

typedef enum job_kind {
  JOB_CALL,  /* job.run on the background thread */
  JOB_POLLED /* never queued: job.poll by test/wait (point-to-point) */
} job_kind_t;

struct gs_request {
  struct gs_request *next; /* queue link */
  job_kind_t kind;
  const char *fn;          /* the entry point that queued it, for messages */
  gs_job_t job;
  int32_t site;            /* the submitter's call site: the flight record names it */
  int done;                /* under the lock: the host part finished */
  gs_status_t status;
  char error[1024];
  /* CUDA memory: the submitter's work stream at submission (dev.ready) and
   * the call's device work (dev.event), which may still run after `done`
   * until the background thread, a wait or a test sees it finish */
  gs_device_done_t dev;
  int device_pending;      /* under the lock */
  int watched;             /* under the lock: the background thread is polling it */
  int handed_off;          /* a stream waits for its device work (gs_request_wait_stream) */
  int orphan;              /* freed by its owner while its device work ran: freed after */
  double queued_at;        /* when the device work was queued (its timeout starts) */
  struct gs_request *next_inflight;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;
static struct gs_request *head, *tail;
static struct gs_request *inflight; /* device work queued, not yet seen finished */
static int worker_started;
static _Atomic int64_t pending;      /* queued or running */

/* ---- entering the runtime ----------------------------------------------- */

/* Before the lock: the worker needs it to finish the queued work. */
static void drain_queued(void) {
  if (atomic_load(&pending) == 0) return;
  pthread_mutex_lock(&lock);
  while (head) pthread_cond_wait(&work_done, &lock);
  pthread_mutex_unlock(&lock);
}

void gs_enter_runtime(void) { gs_runtime_enter(drain_queued); }

void gs_enter_runtime_unordered(void) { gs_runtime_enter(NULL); }

void gs_leave_runtime(void) { gs_runtime_unlock(); }

int64_t gs_requests_pending(void) { return atomic_load(&pending); }

/* Device work of finished host parts: polled by the background thread while
 * it has nothing queued, so a device collective that never ends (a dead
 * peer under NCCL) times out even when nobody waits on the host. */
static void unlink_inflight(struct gs_request *r) {
  for (struct gs_request **p = &inflight; *p; p = &(*p)->next_inflight)
    if (*p == r) {
      *p = r->next_inflight;
      break;
    }
  r->device_pending = 0;
}

static void release(struct gs_request *r) {
  if (r->job.release) r->job.release(r->job.ctx);
  gs_cu_event_free(r->dev.event);
  gs_cu_event_free(r->dev.ready);
  free(r);
}

/* Records the device work's outcome (under the lock). */
static void device_finished(struct gs_request *r, gs_status_t s) {
  if (!r->device_pending) return;
  unlink_inflight(r);
  if (s != GS_SUCCESS && r->status == GS_SUCCESS) {
    r->status = s;
    snprintf(r->error, sizeof r->error, "%s", gs_last_error());
  }
  pthread_cond_broadcast(&work_done);
}

/* Polls one request's device work once (queue lock not held, runtime lock
 * held: see wait_device_part); 1 finished. On a timeout the communicator is
 * marked dead here, under the lock; the transport's abort only takes the
 * NCCL handle out of it, and NCCL's abort runs once the lock is released. */
static int poll_device(struct gs_request *r, gs_status_t *s) {
  gs_cu_scope_t scope;
  *s = gs_cu_enter(r->dev.device, &scope);
  if (*s != GS_SUCCESS) return 1;
  int done = r->dev.transport->poll(r->dev.comm, r->dev.event, r->fn, s);
  double timeout = gs_fate_timeout(&r->dev.comm->fate);
  if (!done && timeout > 0 && gs_now() - r->queued_at > timeout) {
    r->dev.comm->fate.broken = GS_ERR_TIMEOUT;
    if (r->dev.transport->abort) r->dev.transport->abort(r->dev.comm, GS_ERR_TIMEOUT);
    *s = gs_fail(GS_ERR_TIMEOUT,
                 "%s: its device work did not complete within "
                 "%s%g s: a rank may have died or stopped calling "
                 "collectives. The communicator is no longer usable",
                 r->fn,
                 r->dev.comm->fate.timeout > 0 ? "the communicator's timeout of "
                                               : "GRADSYNC_TIMEOUT_SECONDS=",
                 timeout);
    gs_log(GS_LOG_ERROR, "%s", gs_last_error());
    done = 1;
  }
  gs_cu_leave(&scope);
  return done != 0;
}

/* One pass over the requests with device work in flight (lock held). The
 * runtime lock keeps the polls (and an abort's taking of the handle) off a
 * communicator that an application thread is using; an NCCL abort itself
 * runs after gs_runtime_unlock, so it holds up no other thread's call. */
static void watch_devices(void) {
  struct gs_request *pending[64];
  int n = 0;
  for (struct gs_request *r = inflight; r && n < 64; r = r->next_inflight) {
    r->watched = 1; /* gs_request_free waits for the poll to let go */
    pending[n++] = r;
  }
  pthread_mutex_unlock(&lock);
  gs_runtime_lock();
  gs_status_t out[64];
  int done[64];
  for (int k = 0; k < n; k++) done[k] = poll_device(pending[k], &out[k]);
  gs_runtime_unlock();
  pthread_mutex_lock(&lock);
  for (int k = 0; k < n; k++) {
    if (done[k]) device_finished(pending[k], out[k]);
    pending[k]->watched = 0;
    if (pending[k]->orphan && !pending[k]->device_pending) release(pending[k]);
  }
  pthread_cond_broadcast(&work_done);
}

static void *worker(void *arg) {
  (void)arg;
  gs_runtime_set_worker();
  pthread_mutex_lock(&lock);
  for (;;) {
    while (!head) {
      if (!inflight) {
        pthread_cond_wait(&work_ready, &lock);
        continue;
      }
      watch_devices();
      struct timespec t;
      clock_gettime(CLOCK_REALTIME, &t);
      t.tv_nsec += 500000; /* every half millisecond */
      if (t.tv_nsec >= 1000000000L) t.tv_sec++, t.tv_nsec -= 1000000000L;
      if (!head) pthread_cond_timedwait(&work_ready, &lock, &t);
    }
    struct gs_request *r = head; /* stays queued while it runs: drains wait */
    pthread_mutex_unlock(&lock);
    gs_clear_error();
    gs_defer_device = &r->dev;
    gs_flight_set_site(r->site);
    gs_status_t s = r->job.run(r->job.ctx);
    gs_defer_device = NULL;
    pthread_mutex_lock(&lock);
    r->status = s;
    if (s != GS_SUCCESS) snprintf(r->error, sizeof r->error, "%s", gs_last_error());
    if (r->dev.event) {
      r->device_pending = 1;
      r->queued_at = gs_now();
      r->next_inflight = inflight;
      inflight = r;
    }
    head = r->next;
    if (!head) tail = NULL;
    r->done = 1;
    atomic_fetch_sub(&pending, 1);
    pthread_cond_broadcast(&work_done);
  }
  return NULL;
}

/* CUDA memory: the call will follow the work queued on the submitter's work
 * stream so far, and no later work (the caller's backward pass goes on). */
static gs_status_t mark_ready(struct gs_request *r, const gs_tensor_t *touches, int64_t n) {
  if (n == 0 || touches[0].device.kind != GS_DEVICE_CUDA) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(touches[0].device.id, &scope));
  gs_status_t s = gs_cu_record(gs_cu_work_stream(), &r->dev.ready, r->fn);
  gs_cu_leave(&scope);
  return s;
}

static gs_status_t start_worker(const char *fn) {
  if (worker_started) return GS_SUCCESS;
  pthread_t th;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int e = pthread_create(&th, &attr, worker, NULL);
  pthread_attr_destroy(&attr);
  if (e != 0)
    return gs_fail(GS_ERR_INTERNAL, "%s: cannot start the background thread (error %d)", fn, e);
  worker_started = 1;
  return GS_SUCCESS;
}

static gs_status_t thread_level_ok(const char *fn) {
  int level = 0;
  MPI_Query_thread(&level);
  if (level >= MPI_THREAD_SERIALIZED) return GS_SUCCESS;
  return gs_fail(GS_ERR_UNSUPPORTED,
                 "%s: asynchronous collectives run on a background "
                 "thread and need MPI_THREAD_SERIALIZED or higher; MPI was initialized "
                 "with level %d (gradsync asks for SERIALIZED when it initializes MPI)",
                 fn, level);
}

static gs_status_t submit(struct gs_request *r, const gs_tensor_t *touches, int64_t n) {
  GS_CHECK(thread_level_ok(r->fn));
  GS_CHECK(mark_ready(r, touches, n));
  pthread_mutex_lock(&lock);
  gs_status_t s = start_worker(r->fn);
  if (s == GS_SUCCESS) {
    if (tail) tail->next = r;
    else head = r;
    tail = r;
    atomic_fetch_add(&pending, 1);
    pthread_cond_signal(&work_ready);
  }
  pthread_mutex_unlock(&lock);
  return s;
}

/* Hands the finished request's outcome to the caller's thread. */
static gs_status_t outcome(struct gs_request *r) {
  if (r->status != GS_SUCCESS) return gs_fail(r->status, "%s", r->error);
  gs_clear_error();
  return GS_SUCCESS;
}

/* Waits for the host part (the background thread ran the call). */
static void wait_host_part(struct gs_request *r) {
  pthread_mutex_lock(&lock);
  while (!r->done) pthread_cond_wait(&work_done, &lock);
  pthread_mutex_unlock(&lock);
}

static int device_pending(struct gs_request *r) {
  pthread_mutex_lock(&lock);
  int p = r->device_pending;
  pthread_mutex_unlock(&lock);
  return p;
}

/* Waits on the host for the request's device work, polling. The runtime
 * lock is held between polls as the background thread holds it for its own:
 * a poll and an abort's taking of the NCCL handle take turns, so no poll
 * touches a communicator NCCL is freeing (the abort itself runs on the
 * detached handle after the lock is released) and none aborts it twice. */
static void wait_device_part(struct gs_request *r) {
  if (!device_pending(r)) return;
  gs_cu_scope_t scope;
  gs_runtime_lock();
  gs_status_t s = gs_cu_enter(r->dev.device, &scope);
  if (s == GS_SUCCESS) {
    s = gs_device_wait(r->dev.comm, r->dev.transport, r->dev.event, r->fn);
    gs_cu_leave(&scope);
  }
  gs_runtime_unlock();
  pthread_mutex_lock(&lock);
  device_finished(r, s);
  pthread_mutex_unlock(&lock);
}

/* A JOB_POLLED request advances when tested or waited on. */
static gs_status_t polled(struct gs_request *r, int wait, int *done) {
  pthread_mutex_lock(&lock);
  int finished = r->done;
  pthread_mutex_unlock(&lock);
  if (!finished) {
    gs_status_t s = r->job.poll(r->job.ctx, wait, done);
    if (!*done) return GS_SUCCESS;
    pthread_mutex_lock(&lock);
    r->status = s;
    if (s != GS_SUCCESS) snprintf(r->error, sizeof r->error, "%s", gs_last_error());
    r->done = 1;
    pthread_mutex_unlock(&lock);
  }
  *done = 1;
  return outcome(r);
}

gs_status_t gs_request_test(gs_request_t r, int *done) {
  if (!r || !done) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_test: NULL argument");
  if (r->kind == JOB_POLLED) return polled(r, 0, done);
  pthread_mutex_lock(&lock);
  *done = r->done && !r->device_pending;
  int poll = r->done && r->device_pending;
  pthread_mutex_unlock(&lock);
  /* as wait_device_part: one poll or abort at a time; a test never blocks,
   * so with the lock busy it answers "not yet" (whoever holds the lock, or
   * the background thread, polls the request meanwhile) */
  if (poll && gs_runtime_trylock()) {
    gs_status_t s;
    int finished = poll_device(r, &s);
    gs_runtime_unlock();
    pthread_mutex_lock(&lock);
    if (finished) device_finished(r, s);
    *done = !r->device_pending;
    pthread_mutex_unlock(&lock);
  }
  return *done ? outcome(r) : GS_SUCCESS;
}

gs_status_t gs_request_wait(gs_request_t r) {
  if (!r) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait: request is NULL");
  int polled_done;
  if (r->kind == JOB_POLLED) return polled(r, 1, &polled_done);
  if (gs_runtime_in_worker() && !r->done)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_request_wait: called from the background "
                   "thread itself, which would wait forever");
  wait_host_part(r);
  wait_device_part(r);
  return outcome(r);
}

gs_status_t gs_request_wait_stream(gs_request_t r, uintptr_t stream) {
  if (!r) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait_stream: request is NULL");
  if (gs_runtime_in_worker() && !r->done)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_request_wait_stream: called from the "
                   "background thread itself, which would wait forever");
  if (r->kind == JOB_POLLED) return gs_request_wait(r);
  wait_host_part(r);
  if (!r->dev.event || r->status != GS_SUCCESS) return gs_request_wait(r);
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(r->dev.device, &scope));
  gs_status_t s =
      gs_cu_stream_wait_event(gs_cu_as_stream(stream), r->dev.event, "gs_request_wait_stream");
  gs_cu_leave(&scope);
  if (s == GS_SUCCESS) {
    pthread_mutex_lock(&lock);
    r->handed_off = 1;
    pthread_mutex_unlock(&lock);
  }
  return s != GS_SUCCESS ? s : outcome(r);
}

gs_status_t gs_request_stream(gs_request_t r, void **stream) {
  if (!r || !stream) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_stream: NULL argument");
  *stream = NULL;
  if (r->kind == JOB_POLLED) return GS_SUCCESS; /* point to point: no device work queued */
  wait_host_part(r);
  if (!device_pending(r)) return outcome(r);
  *stream = r->dev.stream; /* its communicator's, alive while the work is pending */
  return outcome(r);
}

void gs_async_settle_comm(gs_comm_t c) {
  for (;;) {
    struct gs_request *found = NULL;
    pthread_mutex_lock(&lock);
    for (struct gs_request *r = inflight; r && !found; r = r->next_inflight)
      if (r->dev.comm == c) found = r;
    pthread_mutex_unlock(&lock);
    if (!found) return;
    wait_device_part(found);
    pthread_mutex_lock(&lock);
    while (found->watched) { /* the watcher's pass needs the runtime lock the caller holds */
      pthread_mutex_unlock(&lock);
      gs_runtime_pause(20);
      pthread_mutex_lock(&lock);
    }
    if (found->orphan) release(found);
    pthread_mutex_unlock(&lock);
  }
}

gs_status_t gs_request_free(gs_request_t *request) {
  if (!request || !*request) return GS_SUCCESS;
  gs_request_t r = *request;
  *request = NULL;
  if (r->kind == JOB_POLLED) { /* advances only when waited on */
    (void)gs_request_wait(r);
    release(r);
    gs_clear_error();
    return GS_SUCCESS;
  }
  wait_host_part(r);
  pthread_mutex_lock(&lock);
  if (r->handed_off && r->device_pending) {
    /* a stream waits for it: the host need not; the background thread
     * frees it once the device work is seen finished */
    r->orphan = 1;
    pthread_cond_signal(&work_ready);
    pthread_mutex_unlock(&lock);
    gs_clear_error();
    return GS_SUCCESS;
  }
  pthread_mutex_unlock(&lock);
  (void)gs_request_wait(r); /* its outcome is gs_request_wait's to report */
  pthread_mutex_lock(&lock);
  while (r->watched) pthread_cond_wait(&work_done, &lock);
  pthread_mutex_unlock(&lock);
  release(r);
  gs_clear_error();
  return GS_SUCCESS;
}

gs_status_t gs_async_submit_job(const gs_job_t *job, const gs_tensor_t *touches, int64_t n,
                                gs_request_t *request, const char *fn) {
  gs_clear_error();
  struct gs_request *r = calloc(1, sizeof *r);
  if (!r) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  r->kind = job->run ? JOB_CALL : JOB_POLLED;
  r->fn = fn;
  r->job = *job;
  r->site = gs_flight_current_site();
  r->status = GS_SUCCESS;
  gs_status_t s = r->kind == JOB_CALL ? submit(r, touches, touches ? n : 0) : GS_SUCCESS;
  if (s != GS_SUCCESS) {
    gs_cu_event_free(r->dev.ready);
    free(r); /* the caller still owns job->ctx */
    return s;
  }
  *request = r;
  return GS_SUCCESS;
}
