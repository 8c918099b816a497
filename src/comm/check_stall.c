/* The stall warning: a rank waiting in validation past GRADSYNC_STALL_SECONDS
 * tells the others, and the lowest waiting rank names the ranks that have
 * not arrived (on the communicator's notice channel). */
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "comm/gs_comm_internal.h"

#define NOTICE_TAG 7

/* The line naming the ranks that have not arrived, said by the lowest
 * waiting rank only. */
static void say(gs_comm_t c, const gs_call_t *call, const unsigned char *arrived, int p,
                double waited) {
  for (int r = 0; r < c->rank && r < p; r++)
    if (arrived[r]) return; /* a lower waiting rank speaks for us all */
  char missing[1024] = "", present[1024] = "";
  gs_format_ranks(missing, sizeof missing, arrived, p, 0);
  gs_format_ranks(present, sizeof present, arrived, p, 1);
  gs_log(GS_LOG_WARNING,
         "%s (call #%llu, %lld tensors, %lld bytes) has waited %.1f s; ranks not arrived: %s "
         "(waiting: %s)",
         gs_call_name(call->kind), (unsigned long long)c->seq, (long long)call->n,
         (long long)gs_call_bytes(call), waited, missing, present);
}

/* Tells the other ranks this one is waiting in call `seq`, listens for the
 * same from them for a grace period, then the lowest waiting rank prints one
 * line naming the ranks that have not arrived. Returns early if the call
 * completes meanwhile. */
static void stall_warning(gs_comm_t c, const gs_call_t *call, MPI_Request *req, int *done,
                          double waited) {
  uint64_t note[2] = {c->seq, (uint64_t)c->rank};
  for (int r = 0; r < c->size; r++) {
    if (r == c->rank) continue;
    MPI_Request sreq;
    if (MPI_Isend(note, 2, MPI_UINT64_T, r, NOTICE_TAG, c->notice, &sreq) == MPI_SUCCESS)
      MPI_Request_free(&sreq); /* tiny eager message: completes locally */
  }
  unsigned char arrived[4096];
  int p = c->size < 4096 ? c->size : 4096;
  memset(arrived, 0, (size_t)p);
  if (c->rank < p) arrived[c->rank] = 1;
  double grace = c->stall_seconds < 1.0 ? c->stall_seconds : 1.0, t0 = gs_now();
  while (!*done && gs_now() - t0 < grace) {
    int flag = 0;
    MPI_Status st;
    MPI_Iprobe(MPI_ANY_SOURCE, NOTICE_TAG, c->notice, &flag, &st);
    if (flag) {
      uint64_t got[2];
      MPI_Recv(got, 2, MPI_UINT64_T, st.MPI_SOURCE, NOTICE_TAG, c->notice, MPI_STATUS_IGNORE);
      if (got[0] == c->seq && st.MPI_SOURCE < p) arrived[st.MPI_SOURCE] = 1;
    }
    MPI_Test(req, done, MPI_STATUS_IGNORE);
    sched_yield();
  }
  if (*done) return;
  say(c, call, arrived, p, waited + (gs_now() - t0));
}

/* Whether the stall warning is due now (once per check). */
static int due(gs_stall_t *st, double *w) {
  double now = gs_now();
  if (st->start == 0) st->start = now;
  *w = now - st->start;
  if (st->warned || *w < st->c->stall_seconds) return 0;
  st->warned = 1;
  return 1;
}

/* Every waiting rank's flight record, while it waits. */
static void dump(const gs_stall_t *st, double w) {
  if (st->c->flight < 0 || gs_flight_capacity() <= 0) return;
  char why[160];
  snprintf(why, sizeof why, "stall: %s (call #%llu) has waited %.1f s",
           gs_call_name(st->call->kind), (unsigned long long)st->c->seq, w);
  if (gs_flight_dump(why) == GS_SUCCESS)
    gs_log(GS_LOG_WARNING, "flight record written to %s (python -m gradsync.doctor %s)",
           gs_flight_file(), gs_flight_dir());
}

void gs_stall_tick(void *ctx, MPI_Request *req, int *done, double waited) {
  gs_stall_t *st = ctx;
  (void)waited; /* per wait; the stall counts from the check's first tick */
  double w;
  if (!due(st, &w)) return;
  stall_warning(st->c, st->call, req, done, w);
  if (!*done) dump(st, w);
}

/* Over the shared region every waiting rank sees who has arrived: no notices. */
void gs_stall_tick_shared(void *ctx, const unsigned char *arrived, int p, double waited) {
  gs_stall_t *st = ctx;
  (void)waited;
  double w;
  if (!due(st, &w)) return;
  say(st->c, st->call, arrived, p, w);
  dump(st, w);
}
