/* Asynchronous collectives: one background thread runs queued collectives in
 * issue order, each through its blocking entry point, so an asynchronous
 * call behaves exactly like the blocking one, only later.
 *
 * Why one thread for the whole process: MPI calls then come from one thread
 * at a time (the worker while requests are pending, the caller otherwise,
 * because every blocking collective drains the queue first), which
 * MPI_THREAD_SERIALIZED allows; and issue order is the order the ranks agree
 * on, which a thread per communicator could not keep across communicators. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gs_internal.h"

typedef enum job_kind {
  JOB_ALLREDUCE, JOB_BROADCAST, JOB_AG_SHARDS, JOB_RS_SHARDS,
  JOB_CALL,  /* job.run on the background thread (gs_async_submit_job) */
  JOB_POLLED /* never queued: job.poll by test/wait (point-to-point) */
} job_kind_t;

struct gs_request {
  struct gs_request *next; /* queue link */
  job_kind_t kind;
  gs_comm_t comm;
  gs_tensor_t *tensors;
  int64_t n;
  gs_op_t op;
  double prescale, postscale;
  int root;
  gs_job_t job;            /* JOB_CALL, JOB_POLLED */
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
static _Thread_local int in_worker;

int gs_async_in_worker(void) { return in_worker; }

/* ---- the runtime lock ------------------------------------------------------ */

static pthread_mutex_t runtime_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int depth;      /* nested entries on this thread */
static _Thread_local int registered; /* this application thread has entered */
static _Atomic int app_threads;
_Thread_local gs_comm_t gs_current_comm;

void gs_enter_runtime(void) {
  if (depth++ > 0) return;
  if (!in_worker) {
    if (!registered) {
      registered = 1;
      atomic_fetch_add(&app_threads, 1);
    }
    gs_async_drain(); /* before the lock: the worker needs it to finish */
  }
  pthread_mutex_lock(&runtime_lock);
}

void gs_leave_runtime(void) {
  if (--depth > 0) return;
  gs_current_comm = NULL;
  pthread_mutex_unlock(&runtime_lock);
}

void gs_runtime_pause(int nap_us) {
  if (depth > 0) pthread_mutex_unlock(&runtime_lock);
  if (nap_us > 0) {
    struct timespec t = {0, 1000L * nap_us};
    nanosleep(&t, NULL);
  } else {
    sched_yield();
  }
  if (depth > 0) pthread_mutex_lock(&runtime_lock);
}

int gs_runtime_shared(void) { return atomic_load(&app_threads) > 1; }

int64_t gs_requests_pending(void) { return atomic_load(&pending); }

static gs_status_t run(struct gs_request *r) {
  switch (r->kind) {
    case JOB_ALLREDUCE:
      return gs_allreduce(r->comm, r->tensors, NULL, r->n, r->op, r->prescale, r->postscale);
    case JOB_BROADCAST: return gs_broadcast(r->comm, r->tensors, r->n, r->root);
    case JOB_AG_SHARDS: return gs_allgather_shards(r->comm, r->tensors, r->n);
    case JOB_RS_SHARDS:
      return gs_reduce_scatter_shards(r->comm, r->tensors, r->n, r->op, r->prescale,
                                      r->postscale);
    case JOB_CALL: return r->job.run(r->job.ctx);
    case JOB_POLLED: break;
  }
  return gs_fail(GS_ERR_INTERNAL, "async: unknown job kind %d", (int)r->kind);
}

static const char *run_name(const struct gs_request *r) {
  switch (r->kind) {
    case JOB_ALLREDUCE: return "gs_allreduce_async";
    case JOB_BROADCAST: return "gs_broadcast_async";
    case JOB_AG_SHARDS: return "gs_allgather_shards_async";
    case JOB_RS_SHARDS: return "gs_reduce_scatter_shards_async";
    case JOB_CALL:
    case JOB_POLLED: break;
  }
  return "an asynchronous collective";
}

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
  free(r->tensors);
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

/* Polls one request's device work once (lock not held); 1 finished. */
static int poll_device(struct gs_request *r, gs_status_t *s) {
  gs_cu_scope_t scope;
  *s = gs_cu_enter(r->dev.device, &scope);
  if (*s != GS_SUCCESS) return 1;
  int done = r->dev.transport->poll(r->dev.comm, r->dev.event, s);
  double timeout = gs_env_timeout_seconds();
  if (!done && timeout > 0 && gs_now() - r->queued_at > timeout) {
    r->dev.comm->broken = GS_ERR_TIMEOUT;
    if (r->dev.transport->abort) r->dev.transport->abort(r->dev.comm, GS_ERR_TIMEOUT);
    *s = gs_fail(GS_ERR_TIMEOUT, "%s: its device work did not complete within "
                 "GRADSYNC_TIMEOUT_SECONDS=%g s: a rank may have died or stopped calling "
                 "collectives. The communicator is no longer usable", run_name(r), timeout);
    gs_log(GS_LOG_ERROR, "%s", gs_last_error());
    done = 1;
  }
  gs_cu_leave(&scope);
  return done != 0;
}

/* One pass over the requests with device work in flight (lock held). The
 * runtime lock keeps the polls (and an abort) off a communicator that an
 * application thread is using. */
static void watch_devices(void) {
  struct gs_request *pending[64];
  int n = 0;
  for (struct gs_request *r = inflight; r && n < 64; r = r->next_inflight) {
    r->watched = 1; /* gs_request_free waits for the poll to let go */
    pending[n++] = r;
  }
  pthread_mutex_unlock(&lock);
  pthread_mutex_lock(&runtime_lock);
  gs_status_t out[64];
  int done[64];
  for (int k = 0; k < n; k++) done[k] = poll_device(pending[k], &out[k]);
  pthread_mutex_unlock(&runtime_lock);
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
  in_worker = 1;
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
    gs_status_t s = run(r);
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

void gs_async_drain(void) {
  if (in_worker || atomic_load(&pending) == 0) return;
  pthread_mutex_lock(&lock);
  while (head) pthread_cond_wait(&work_done, &lock);
  pthread_mutex_unlock(&lock);
}

/* CUDA memory: the call will follow the work queued on the submitter's work
 * stream so far, and no later work (the caller's backward pass goes on). */
static gs_status_t mark_ready(struct gs_request *r, const char *fn) {
  if (r->n == 0 || r->tensors[0].device.kind != GS_DEVICE_CUDA) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(r->tensors[0].device.id, &scope));
  gs_status_t s = gs_cu_record(gs_cu_work_stream(), &r->dev.ready, fn);
  gs_cu_leave(&scope);
  return s;
}

static gs_status_t submit(struct gs_request *proto, const gs_tensor_t *t, gs_request_t *out,
                          const char *fn) {
  if (!out) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: request is NULL", fn);
  *out = NULL;
  GS_CHECK(gs_comm_valid(proto->comm, fn));
  if (proto->n < 0 || (proto->n > 0 && !t))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: tensors is NULL or n is negative", fn);
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED)
    return gs_fail(GS_ERR_UNSUPPORTED, "%s: asynchronous collectives run on a background "
                   "thread and need MPI_THREAD_SERIALIZED or higher; MPI was initialized "
                   "with level %d (gradsync asks for SERIALIZED when it initializes MPI)",
                   fn, level);
  struct gs_request *r = malloc(sizeof *r);
  gs_tensor_t *copy = malloc((size_t)(proto->n ? proto->n : 1) * sizeof *copy);
  if (!r || !copy) {
    free(r);
    free(copy);
    return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  }
  *r = *proto;
  if (proto->n) memcpy(copy, t, (size_t)proto->n * sizeof *copy);
  r->tensors = copy;
  r->next = NULL;
  r->done = 0;
  r->status = GS_SUCCESS;
  r->error[0] = '\0';
  memset(&r->dev, 0, sizeof r->dev);
  r->device_pending = 0;
  r->watched = 0;
  r->handed_off = 0;
  r->orphan = 0;
  r->next_inflight = NULL;
  gs_status_t ready = mark_ready(r, fn);
  if (ready != GS_SUCCESS) {
    free(copy);
    free(r);
    return ready;
  }
  pthread_mutex_lock(&lock);
  if (!worker_started) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&th, &attr, worker, NULL);
    pthread_attr_destroy(&attr);
    if (e != 0) {
      pthread_mutex_unlock(&lock);
      free(copy);
      free(r);
      return gs_fail(GS_ERR_INTERNAL, "%s: cannot start the background thread (error %d)",
                     fn, e);
    }
    worker_started = 1;
  }
  if (tail) tail->next = r;
  else head = r;
  tail = r;
  atomic_fetch_add(&pending, 1);
  pthread_cond_signal(&work_ready);
  pthread_mutex_unlock(&lock);
  *out = r;
  return GS_SUCCESS;
}

gs_status_t gs_allreduce_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                               gs_op_t op, double prescale, double postscale,
                               gs_request_t *request) {
  gs_clear_error();
  struct gs_request p = {.kind = JOB_ALLREDUCE, .comm = comm, .n = n, .op = op,
                         .prescale = prescale, .postscale = postscale};
  return submit(&p, tensors, request, "gs_allreduce_async");
}

gs_status_t gs_broadcast_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int root,
                               gs_request_t *request) {
  gs_clear_error();
  struct gs_request p = {.kind = JOB_BROADCAST, .comm = comm, .n = n, .root = root};
  return submit(&p, tensors, request, "gs_broadcast_async");
}

gs_status_t gs_allgather_shards_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                      gs_request_t *request) {
  gs_clear_error();
  struct gs_request p = {.kind = JOB_AG_SHARDS, .comm = comm, .n = n};
  return submit(&p, tensors, request, "gs_allgather_shards_async");
}

gs_status_t gs_reduce_scatter_shards_async(gs_comm_t comm, const gs_tensor_t *tensors,
                                           int64_t n, gs_op_t op, double prescale,
                                           double postscale, gs_request_t *request) {
  gs_clear_error();
  struct gs_request p = {.kind = JOB_RS_SHARDS, .comm = comm, .n = n, .op = op,
                         .prescale = prescale, .postscale = postscale};
  return submit(&p, tensors, request, "gs_reduce_scatter_shards_async");
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

/* Waits on the host for the request's device work, polling. */
static void wait_device_part(struct gs_request *r) {
  if (!device_pending(r)) return;
  gs_cu_scope_t scope;
  gs_status_t s = gs_cu_enter(r->dev.device, &scope);
  if (s == GS_SUCCESS) {
    s = gs_device_wait(r->dev.comm, r->dev.transport, r->dev.event, run_name(r));
    gs_cu_leave(&scope);
  }
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
  if (poll) {
    gs_status_t s;
    int finished = poll_device(r, &s);
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
  if (in_worker && !r->done)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait: called from the background "
                   "thread itself, which would wait forever");
  wait_host_part(r);
  wait_device_part(r);
  return outcome(r);
}

gs_status_t gs_request_wait_stream(gs_request_t r, uintptr_t stream) {
  if (!r) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait_stream: request is NULL");
  if (in_worker && !r->done)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait_stream: called from the "
                   "background thread itself, which would wait forever");
  if (r->kind == JOB_POLLED) return gs_request_wait(r);
  wait_host_part(r);
  if (!r->dev.event || r->status != GS_SUCCESS) return gs_request_wait(r);
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(r->dev.device, &scope));
  gs_status_t s = gs_cu_stream_wait_event(gs_cu_as_stream(stream), r->dev.event,
                                          "gs_request_wait_stream");
  gs_cu_leave(&scope);
  if (s == GS_SUCCESS) {
    pthread_mutex_lock(&lock);
    r->handed_off = 1;
    pthread_mutex_unlock(&lock);
  }
  return s != GS_SUCCESS ? s : outcome(r);
}

gs_status_t gs_request_stream(gs_request_t r, void **stream) {
  if (!r || !stream)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_stream: NULL argument");
  *stream = NULL;
  if (r->kind == JOB_POLLED) return GS_SUCCESS; /* point to point: no device work queued */
  wait_host_part(r);
  if (!device_pending(r)) return outcome(r);
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(r->dev.device, &scope));
  gs_status_t s = gs_cu_comm_stream(r->dev.device, stream);
  gs_cu_leave(&scope);
  return s != GS_SUCCESS ? s : outcome(r);
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
    while (found->watched) pthread_cond_wait(&work_done, &lock);
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

gs_status_t gs_async_submit_job(gs_comm_t comm, const gs_job_t *job, const gs_tensor_t *touches,
                                int64_t n, gs_request_t *request, const char *fn) {
  gs_clear_error();
  if (job->run) {
    static const gs_tensor_t none;
    /* the job holds its own arguments; the descriptors only say where they live */
    struct gs_request p = {.kind = JOB_CALL, .comm = comm, .job = *job, .n = touches ? n : 0};
    return submit(&p, touches ? touches : &none, request, fn);
  }
  struct gs_request *r = calloc(1, sizeof *r);
  if (!r) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  r->kind = JOB_POLLED;
  r->comm = comm;
  r->job = *job;
  r->status = GS_SUCCESS;
  *request = r;
  return GS_SUCCESS;
}

void gs_enter_runtime_unordered(void) {
  if (depth++ > 0) return;
  if (!in_worker && !registered) {
    registered = 1;
    atomic_fetch_add(&app_threads, 1);
  }
  pthread_mutex_lock(&runtime_lock);
}
