/* The runtime lock and the fate of the communicator each thread works on. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "gs_runtime.h"

static pthread_mutex_t runtime_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int depth;      /* nested holds on this thread */
static _Thread_local int registered; /* this application thread has entered */
static _Thread_local int in_worker;
static _Thread_local gs_fate_t *bound;
static _Atomic int app_threads;

void gs_runtime_register_thread(void) {
  if (in_worker || registered) return;
  registered = 1;
  atomic_fetch_add(&app_threads, 1);
}

void gs_runtime_lock(void) {
  if (depth++ > 0) return;
  pthread_mutex_lock(&runtime_lock);
}

void gs_runtime_unlock(void) {
  if (--depth > 0) return;
  bound = NULL;
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

int gs_runtime_held(void) { return depth > 0; }
int gs_runtime_shared(void) { return atomic_load(&app_threads) > 1; }
int gs_runtime_in_worker(void) { return in_worker; }
void gs_runtime_set_worker(void) { in_worker = 1; }

gs_fate_t *gs_runtime_bind(gs_fate_t *fate) {
  gs_fate_t *before = bound;
  bound = fate;
  return before;
}

void gs_runtime_mark_broken(gs_status_t why) {
  if (bound) bound->broken = why;
}

int gs_runtime_owns_core(void) { return bound && bound->owns_core; }
