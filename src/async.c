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
  int done;                /* under the lock */
  gs_status_t status;
  char error[1024];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;
static struct gs_request *head, *tail;
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

static void *worker(void *arg) {
  (void)arg;
  in_worker = 1;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (!head) pthread_cond_wait(&work_ready, &lock);
    struct gs_request *r = head; /* stays queued while it runs: drains wait */
    pthread_mutex_unlock(&lock);
    gs_clear_error();
    gs_status_t s = run(r);
    pthread_mutex_lock(&lock);
    r->status = s;
    if (s != GS_SUCCESS) snprintf(r->error, sizeof r->error, "%s", gs_last_error());
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
  *done = r->done;
  pthread_mutex_unlock(&lock);
  return *done ? outcome(r) : GS_SUCCESS;
}

gs_status_t gs_request_wait(gs_request_t r) {
  if (!r) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait: request is NULL");
  int polled_done;
  if (r->kind == JOB_POLLED) return polled(r, 1, &polled_done);
  if (in_worker && !r->done)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_request_wait: called from the background "
                   "thread itself, which would wait forever");
  pthread_mutex_lock(&lock);
  while (!r->done) pthread_cond_wait(&work_done, &lock);
  pthread_mutex_unlock(&lock);
  return outcome(r);
}

gs_status_t gs_request_free(gs_request_t *request) {
  if (!request || !*request) return GS_SUCCESS;
  gs_request_t r = *request;
  (void)gs_request_wait(r); /* its outcome is gs_request_wait's to report */
  if (r->job.release) r->job.release(r->job.ctx);
  free(r->tensors);
  free(r);
  *request = NULL;
  gs_clear_error();
  return GS_SUCCESS;
}

gs_status_t gs_async_submit_job(gs_comm_t comm, const gs_job_t *job, gs_request_t *request,
                                const char *fn) {
  gs_clear_error();
  if (job->run) {
    static const gs_tensor_t none; /* the job holds its own arguments */
    struct gs_request p = {.kind = JOB_CALL, .comm = comm, .job = *job};
    return submit(&p, &none, request, fn);
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
