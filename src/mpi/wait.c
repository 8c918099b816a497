/* Waiting on MPI: every request completes through the one wait loop
 * (progress.c), so it times out, yields the core, and lets other threads
 * in; MPI's errors become gradsync statuses with MPI's own words. */
#include <stdio.h>

#include "mpi/gs_mpi.h"

gs_status_t gs_mpi_fail(int mpi_err, const char *what) {
  char msg[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (MPI_Error_string(mpi_err, msg, &len) != MPI_SUCCESS) len = 0;
  msg[len] = '\0';
  return gs_fail(GS_ERR_MPI, "%s failed: %s", what, len ? msg : "unknown MPI error");
}

int gs_use_blocking(gs_comm_t c, int64_t bytes) {
  /* A blocking call cannot time out, be interrupted, or let another thread
   * in while it waits: two threads each blocked in a call on their own
   * communicator, in opposite orders on two ranks, would wait for each
   * other forever. So only where MPI itself rules threads out. */
  static int single = -1;
  if (single < 0) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    single = level <= MPI_THREAD_FUNNELED;
  }
  return single && c->fate.owns_core && bytes < GS_BLOCKING_MAX_BYTES &&
         gs_call_timeout(&c->fate, NULL) == 0.0;
}

gs_status_t gs_mpi_finish(int e, MPI_Request *req, const char *what) {
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, what);
  return req ? gs_mpi_wait(req, what, NULL, NULL) : GS_SUCCESS;
}

/* gs_mpi_wait through the one wait loop. */
typedef struct mpi_wait {
  MPI_Request *req;
  const char *what;
  gs_wait_tick tick;
  void *ctx;
} mpi_wait_t;

static int mpi_poll(void *ctx, gs_status_t *err) {
  mpi_wait_t *m = ctx;
  int done = 0, e = MPI_Test(m->req, &done, MPI_STATUS_IGNORE);
  if (e != MPI_SUCCESS) {
    *err = gs_mpi_fail(e, m->what);
    return -1;
  }
  return done;
}

static void mpi_tick(void *ctx, double waited) {
  mpi_wait_t *m = ctx;
  int done = 0;
  m->tick(m->ctx, m->req, &done, waited); /* a completed request tests done next */
}

/* The request may point at memory the caller is about to release
 * (validation messages live on the stack), so it is cancelled (receives
 * cancel reliably) and given a moment to finish; one that will not is
 * released to MPI. */
static void mpi_cancel(void *ctx, gs_status_t why) {
  mpi_wait_t *m = ctx;
  (void)why;
  if (*m->req == MPI_REQUEST_NULL) return;
  MPI_Cancel(m->req);
  int done = 0;
  double until = gs_now() + 0.1;
  while (!done && gs_now() < until)
    if (MPI_Test(m->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
  if (!done && *m->req != MPI_REQUEST_NULL) MPI_Request_free(m->req);
}

gs_status_t gs_mpi_wait(MPI_Request *req, const char *what, gs_wait_tick tick, void *ctx) {
  mpi_wait_t m = {req, what, tick, ctx};
  gs_wait_t w = {mpi_poll, mpi_cancel, tick ? mpi_tick : NULL, NULL, &m, what};
  return gs_progress_wait(&w);
}
