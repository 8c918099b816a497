/* The barrier, and a rank's abandoned call: collectives without tensors,
 * through the skeleton like every other call (counted, recorded in the
 * flight recorder, carrying the thread's call options). */
#include "coll/gs_collective.h"

/* With validation on, the check is the barrier; otherwise MPI's. */
static gs_status_t barrier_validate(gs_comm_t c, gs_coll_t *d, gs_status_t local) {
  if (c->check || local != GS_SUCCESS) return gs_begin_call(c, &d->call, local);
  c->stats.calls++;
  MPI_Request req;
  GS_MPI_CHECK(MPI_Ibarrier(c->mpi, &req), "gs_barrier: MPI_Ibarrier");
  return gs_mpi_wait(&req, "gs_barrier: MPI_Ibarrier", NULL, NULL);
}

gs_status_t gs_barrier(gs_comm_t c) {
  gs_coll_t d = {.fn = "gs_barrier", .name = "barrier", .kind = GS_CALL_BARRIER};
  d.validate = barrier_validate;
  return gs_collective(c, &d);
}

/* This rank's arguments were rejected above gradsync (the Python layer):
 * its check fails with the caller's status and reason. */
typedef struct abandon_args {
  gs_status_t status;
  const char *reason;
} abandon_args_t;

static gs_status_t abandon_check(gs_comm_t c, gs_coll_t *d) {
  (void)c;
  const abandon_args_t *a = d->extra;
  return gs_fail(a->status, "%s", a->reason ? a->reason : "invalid arguments");
}

gs_status_t gs_comm_abandon(gs_comm_t c, gs_status_t status, const char *reason) {
  abandon_args_t a = {status == GS_SUCCESS ? GS_ERR_INVALID_ARGUMENT : status, reason};
  /* recorded as what it is: this rank gave up on its call (bad arguments);
   * the others' call, whatever it is, fails naming this rank's reason */
  gs_coll_t d = {.fn = "gs_comm_abandon", .name = "abandon", .kind = GS_CALL_BARRIER};
  d.extra = &a;
  d.check = abandon_check;
  d.own_checks = 1;
  d.record_as = "abandon";
  return gs_collective(c, &d);
}
