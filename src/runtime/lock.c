/* The runtime lock and the fate of the communicator each thread works on. */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "gs_comm.h"
#include "runtime/gs_runtime.h"

static pthread_mutex_t runtime_lock = PTHREAD_MUTEX_INITIALIZER;

/* Work deferred until the thread releases the lock (gs_runtime_after_unlock). */
typedef struct after_unlock {
  void (*fn)(void *);
  void *arg;
  struct after_unlock *next;
} after_unlock_t;

/* Everything the runtime keeps per thread, in one thread-local struct: in a
 * shared library each function then pays for one thread-local lookup (a
 * call into the dynamic linker) however many fields it touches. */
typedef struct thread_state {
  int depth;      /* nested holds of the lock on this thread */
  int in_worker;  /* this is gradsync's background thread */
  gs_fate_t *bound;
  after_unlock_t *after, **after_tail; /* run once the lock is released */
  gs_call_options_t options; /* gs_set_call_options: this thread's calls carry them */
} thread_state_t;
static _Thread_local thread_state_t me;

void gs_runtime_enter(void (*first)(void)) {
  thread_state_t *t = &me;
  if (t->depth == 0 && !t->in_worker && first) first();
  if (t->depth++ == 0) pthread_mutex_lock(&runtime_lock);
}

void gs_runtime_lock(void) {
  if (me.depth++ > 0) return;
  pthread_mutex_lock(&runtime_lock);
}

int gs_runtime_trylock(void) {
  if (me.depth > 0) {
    me.depth++;
    return 1;
  }
  if (pthread_mutex_trylock(&runtime_lock) != 0) return 0;
  me.depth = 1;
  return 1;
}

void gs_runtime_unlock(void) {
  thread_state_t *t = &me;
  if (--t->depth > 0) return;
  t->bound = NULL;
  after_unlock_t *a = t->after;
  t->after = NULL;
  pthread_mutex_unlock(&runtime_lock);
  while (a) { /* in the order they were deferred */
    after_unlock_t *next = a->next;
    a->fn(a->arg);
    free(a);
    a = next;
  }
}

void gs_runtime_after_unlock(void (*fn)(void *), void *arg) {
  thread_state_t *t = &me;
  after_unlock_t *a = t->depth > 0 ? malloc(sizeof *a) : NULL;
  if (!a) { /* not holding the lock (or out of memory): now */
    fn(arg);
    return;
  }
  a->fn = fn;
  a->arg = arg;
  a->next = NULL;
  if (!t->after) t->after_tail = &t->after;
  *t->after_tail = a;
  t->after_tail = &a->next;
}

void gs_runtime_pause(int nap_us) {
  int depth = me.depth;
  if (depth > 0) pthread_mutex_unlock(&runtime_lock);
  if (nap_us > 0) {
    struct timespec t = {0, 1000L * nap_us};
    nanosleep(&t, NULL);
  } else {
    sched_yield();
  }
  if (depth > 0) pthread_mutex_lock(&runtime_lock);
}

int gs_runtime_in_worker(void) { return me.in_worker; }
void gs_runtime_set_worker(void) { me.in_worker = 1; }

gs_fate_t *gs_runtime_bind(gs_fate_t *fate) {
  thread_state_t *t = &me;
  gs_fate_t *before = t->bound;
  t->bound = fate;
  return before;
}

void gs_runtime_mark_broken(gs_status_t why) {
  gs_fate_t *f = me.bound;
  if (!f) return;
  if (!f->broken && f->tell) f->tell(f->watch_ctx, why);
  f->broken = why;
}

int gs_runtime_owns_core(void) {
  gs_fate_t *f = me.bound;
  return f && f->owns_core;
}

double gs_fate_timeout(const gs_fate_t *fate) {
  return fate && fate->timeout > 0 ? fate->timeout : gs_env_timeout_seconds();
}

gs_status_t gs_runtime_watch(const char *what) {
  gs_fate_t *f = me.bound;
  return f && f->watch ? f->watch(f->watch_ctx, what) : GS_SUCCESS;
}

gs_status_t gs_set_call_options(const gs_call_options_t *options) {
  gs_clear_error();
  if (options && !(options->timeout >= 0))
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_set_call_options: timeout must be >= 0 seconds (0: the communicator's), "
                   "got %g",
                   options->timeout);
  me.options = options ? *options : (gs_call_options_t){0, 0};
  return GS_SUCCESS;
}

gs_call_options_t gs_runtime_swap_call_options(gs_call_options_t options) {
  gs_call_options_t before = me.options;
  me.options = options;
  return before;
}

void gs_get_call_options(gs_call_options_t *options) {
  if (options) *options = me.options;
}

double gs_call_timeout(const gs_fate_t *fate, const char **which) {
  if (me.options.timeout > 0) {
    if (which) *which = "the call's timeout of ";
    return me.options.timeout;
  }
  if (which)
    *which =
        fate && fate->timeout > 0 ? "the communicator's timeout of " : "GRADSYNC_TIMEOUT_SECONDS=";
  return gs_fate_timeout(fate);
}

double gs_runtime_timeout(const char **which) { return gs_call_timeout(me.bound, which); }
