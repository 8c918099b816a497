/* gradsync private, runtime/ (a layer: docs/ARCHITECTURE.md): the runtime lock, what a thread knows
 * of the communicator it is working on (its fate), and the one loop behind
 * every wait on every transport (progress.c). */
#ifndef GRADSYNC_RUNTIME_H
#define GRADSYNC_RUNTIME_H

#include "base/gs_base.h"
#include "kernels/gs_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the runtime lock (lock.c) ---------------------------------------------
 * Keeps gradsync's MPI calls one at a time across threads
 * (MPI_THREAD_SERIALIZED). Waits release it between polls
 * (gs_runtime_pause), so threads driving different communicators all
 * progress. Nested holds are counted. The queue (queue.c) takes it through
 * gs_enter_runtime, which first lets queued asynchronous work finish. */
void gs_runtime_lock(void);
void gs_runtime_unlock(void);
/* gs_runtime_lock if it is free (or already this thread's): 1 taken, 0 not. */
int gs_runtime_trylock(void);
/* gs_runtime_lock for an entry point: on an application thread's outermost
 * entry it first runs `first` (NULL: nothing) before taking the lock. */
void gs_runtime_enter(void (*first)(void));
/* Lets other threads in while this one waits (sleeping nap_us microseconds,
 * or just yielding for 0); returns with the lock again. */
void gs_runtime_pause(int nap_us);
/* Whether the calling thread is gradsync's background thread (queue.c sets
 * it at the thread's start). */
int gs_runtime_in_worker(void);
void gs_runtime_set_worker(void);
/* Runs fn(arg) on this thread once it has released the runtime lock
 * (its outermost gs_runtime_unlock), or at once when it does not hold it:
 * for work that must not keep other threads out, such as an NCCL abort,
 * which may take seconds. What fn touches must have been taken out of
 * shared reach under the lock first. */
void gs_runtime_after_unlock(void (*fn)(void *), void *arg);

/* ---- a communicator's fate (lock.c) -----------------------------------------
 * What the waits need of the communicator a thread works on: where a wait
 * that gives up (timeout, interrupt, a lost device context) records why,
 * which leaves the communicator unusable, and whether its ranks each own a
 * core (short spins are then cheap). Communicators embed one and bind it
 * for the length of a call. */
typedef struct gs_fate {
  gs_status_t broken; /* GS_SUCCESS while usable */
  int owns_core; /* ranks on this node <= its cores */
  double timeout; /* > 0: its own wait limit (gs_comm_set_timeout); 0: the process's */
  /* May be NULL: asked about every 0.1 s while one of the communicator's
   * waits lasts, whatever it waits on; a failure (a peer's process gone,
   * GS_ERR_PEER_LOST, its message recorded) ends the wait at once. */
  gs_status_t (*watch)(void *ctx, const char *what);
  /* May be NULL: told once when this rank marks the communicator broken,
   * so the peers learn it (ctx: watch_ctx). */
  void (*tell)(void *ctx, gs_status_t why);
  void *watch_ctx;
} gs_fate_t;
/* Binds `fate` to the calling thread; returns the one bound before. The
 * binding ends with gs_runtime_unlock's outermost release. */
gs_fate_t *gs_runtime_bind(gs_fate_t *fate);
/* Marks the bound communicator unusable (no-op when none is bound), telling
 * its peers where it can (the fate's tell). */
void gs_runtime_mark_broken(gs_status_t why);
/* Whether the bound communicator's ranks own their cores. */
int gs_runtime_owns_core(void);
/* The wait limit of `fate` (NULL: of none): its own timeout when set, else
 * GRADSYNC_TIMEOUT_SECONDS (gs_set_timeout_seconds); 0: wait forever. */
double gs_fate_timeout(const gs_fate_t *fate);
/* The wait limit of a call on `fate` made by this thread: the thread's call
 * options' timeout (gs_set_call_options) when set, else gs_fate_timeout.
 * *which (may be NULL) names where it comes from, for the timeout message
 * ("the call's timeout of ", "the communicator's timeout of ",
 * "GRADSYNC_TIMEOUT_SECONDS="). */
double gs_call_timeout(const gs_fate_t *fate, const char **which);
/* Makes `options` the calling thread's call options and returns those it
 * had (gs_set_call_options without its checks or error reset: the
 * background thread runs a queued call under its caller's). */
gs_call_options_t gs_runtime_swap_call_options(gs_call_options_t options);
/* gs_call_timeout of the bound communicator. */
double gs_runtime_timeout(const char **which);
/* The bound communicator's watch (GS_SUCCESS when it has none). */
gs_status_t gs_runtime_watch(const char *what);

/* ---- waiting (progress.c): every wait on every transport ------------------- */

/* What a wait polls. poll: 1 done, 0 not yet, -1 failed (*err set, message
 * recorded). abandon (may be NULL): called when the wait gives up (timeout,
 * interrupt) to cancel or abort what is pending. tick (may be NULL): about
 * every 128 polls with the seconds waited. detail (may be NULL): more words
 * for the timeout message (NCCL's last error). */
typedef struct gs_wait {
  int (*poll)(void *ctx, gs_status_t *err);
  void (*abandon)(void *ctx, gs_status_t why);
  void (*tick)(void *ctx, double waited);
  const char *(*detail)(void *ctx);
  void *ctx;
  const char *what;
} gs_wait_t;
/* Polls until done, yielding the core and releasing the runtime lock between
 * polls; GRADSYNC_TIMEOUT_SECONDS and interrupts end it with GS_ERR_TIMEOUT
 * or GS_ERR_INTERRUPTED and leave the bound communicator unusable. */
gs_status_t gs_progress_wait(const gs_wait_t *w);

#ifdef __cplusplus
}
#endif
#endif
