/* Every wait in gradsync, on any transport: an MPI request, a CUDA event, an
 * NCCL communicator. One loop polls, yields the core and releases the
 * runtime lock between polls, checks for interrupts, gives up after the
 * bound communicator's timeout (GRADSYNC_TIMEOUT_SECONDS unless it has its
 * own), and on giving up leaves the communicator
 * unusable and lets the waiter cancel or abort what it waited for. */
#include "gs_comm.h"
#include "runtime/gs_runtime.h"

static gs_interrupt_check_t interrupt_check;
static const double interrupt_every = 0.1; /* seconds between checks (and watches) */

void gs_set_interrupt_check(gs_interrupt_check_t check) { interrupt_check = check; }

/* The communicator's watch found a peer gone: the wait ends with its
 * status and message, the communicator unusable. */
static gs_status_t lost(const gs_wait_t *w, gs_status_t why) {
  gs_runtime_mark_broken(why);
  if (w->abandon) w->abandon(w->ctx, why);
  return why;
}

/* Gives up: the communicator cannot be trusted afterwards (other ranks, or
 * the device, may still be inside the call). */
static gs_status_t abandon(const gs_wait_t *w, gs_status_t why, double waited, double limit,
                           const char *which) {
  gs_runtime_mark_broken(why);
  if (w->abandon) w->abandon(w->ctx, why);
  const char *detail = w->detail ? w->detail(w->ctx) : NULL;
  if (why == GS_ERR_TIMEOUT)
    return gs_fail(why,
                   "%s did not complete within %s%g s (waited %.1f "
                   "s): a rank may have died or stopped calling collectives%s%s. The "
                   "communicator is no longer usable",
                   w->what, which, limit, waited, detail && *detail ? "; " : "",
                   detail ? detail : "");
  return gs_fail(why, "%s was interrupted after %.1f s; the communicator is no longer usable",
                 w->what, waited);
}

gs_status_t gs_progress_wait(const gs_wait_t *w) {
  /* the call's limit (gs_set_call_options), the communicator's
   * (gs_comm_set_timeout), or the process's */
  const char *which = NULL;
  double t0 = 0, start = 0, last_check = 0, timeout = gs_runtime_timeout(&which);
  /* with a core of its own, a rank spins as MPI's blocking calls do for the
   * first 50 microseconds (the peer is running too), then starts yielding */
  const double spin_until = gs_runtime_owns_core() ? 50e-6 : 0.0;
  for (unsigned long spins = 0;; spins++) {
    gs_status_t err = GS_SUCCESS;
    int done = w->poll(w->ctx, &err);
    if (done > 0) return GS_SUCCESS;
    if (done < 0) return err;
    if ((spins & 127) != 127) continue;
    if (spin_until > 0) {
      double t = gs_now();
      if (start == 0) start = last_check = t;
      if (t - start < spin_until) continue;
    }
    /* Past the first microseconds, hand the core to whoever we wait for:
     * with more ranks than cores, MPI's own blocking calls spin for a whole
     * time slice per step (milliseconds) while the peer cannot run. The
     * background thread naps instead (20 us, then 200 us past 1 ms): the
     * cores belong to the computation it overlaps with, and what it waits
     * for is usually the other ranks' backward pass. */
    double t = gs_now();
    gs_runtime_pause(gs_runtime_in_worker() ? (start == 0 || t - start < 1e-3 ? 20 : 200) : 0);
    if (start == 0) start = last_check = t;
    if (timeout > 0 && t - start > timeout)
      return abandon(w, GS_ERR_TIMEOUT, t - start, timeout, which);
    if (t - last_check >= interrupt_every) {
      last_check = t;
      if (interrupt_check && !gs_runtime_in_worker() && interrupt_check())
        return abandon(w, GS_ERR_INTERRUPTED, t - start, timeout, which);
      gs_status_t gone = gs_runtime_watch(w->what);
      if (gone != GS_SUCCESS) return lost(w, gone);
    }
    if (w->tick) {
      if (t0 == 0) t0 = t;
      w->tick(w->ctx, t - t0);
    }
  }
}
