/* Host MPI for the exchange collectives: MPI's own alltoallv, gatherv,
 * scatterv and reduce (nonblocking, so waits time out and yield). Every
 * wait is gs_mpi_wait. */
#include <limits.h>
#include <stdlib.h>

#include "transport/gs_transport.h"

/* counts and displacements as ints (the caller checked that they fit). */
static int *int_copy(const int64_t *a, const int64_t *b, int p) {
  int *v = malloc(2 * (size_t)(p > 0 ? p : 1) * sizeof *v);
  for (int r = 0; v && r < p; r++) {
    v[r] = a ? (int)a[r] : 0;
    v[p + r] = b ? (int)b[r] : 0;
  }
  return v;
}

gs_status_t gs_mpi_alltoallv(gs_comm_t c, const gs_xfer_t *x) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(x->dtype, &dt));
  int p = c->size;
  int *s = int_copy(x->scounts, x->sdispls, p), *r = int_copy(x->rcounts, x->rdispls, p);
  gs_status_t st = GS_SUCCESS;
  if (!s || !r) st = gs_fail(GS_ERR_NO_MEMORY, "gs_alltoallv: out of memory");
  if (st == GS_SUCCESS) {
    int64_t total = 0;
    for (int q = 0; q < p; q++) total += x->scounts[q];
    gs_count_message(c, total, x->dtype);
    MPI_Request req;
    st = gs_mpi_finish(MPI_Ialltoallv(x->send, s, s + p, dt, x->recv, r, r + p, dt, c->mpi, &req),
                       &req, "gs_alltoallv: MPI_Ialltoallv");
  }
  free(s); /* only now: MPI reads the counts until the call completes */
  free(r);
  return st;
}

gs_status_t gs_mpi_gatherv(gs_comm_t c, const gs_xfer_t *x) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(x->dtype, &dt));
  int root = c->rank == x->root, p = c->size;
  int *r = root ? int_copy(x->rcounts, x->rdispls, p) : NULL;
  if (root && !r) return gs_fail(GS_ERR_NO_MEMORY, "gs_gatherv: out of memory");
  gs_count_message(c, x->scount, x->dtype);
  MPI_Request req;
  gs_status_t st = gs_mpi_finish(MPI_Igatherv(x->send, (int)x->scount, dt, x->recv, r,
                                              r ? r + p : NULL, dt, x->root, c->mpi, &req),
                                 &req, "gs_gatherv: MPI_Igatherv");
  free(r);
  return st;
}

gs_status_t gs_mpi_scatterv(gs_comm_t c, const gs_xfer_t *x) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(x->dtype, &dt));
  int root = c->rank == x->root, p = c->size;
  int *s = root ? int_copy(x->scounts, x->sdispls, p) : NULL;
  if (root && !s) return gs_fail(GS_ERR_NO_MEMORY, "gs_scatterv: out of memory");
  gs_count_message(c, x->rcount, x->dtype);
  MPI_Request req;
  gs_status_t st = gs_mpi_finish(MPI_Iscatterv(x->send, s, s ? s + p : NULL, dt, x->recv,
                                               (int)x->rcount, dt, x->root, c->mpi, &req),
                                 &req, "gs_scatterv: MPI_Iscatterv");
  free(s);
  return st;
}

gs_status_t gs_mpi_reduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                          gs_dtype_t dtype, gs_op_t op, int root) {
  MPI_Datatype dt;
  MPI_Op mop;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  gs_count_message(c, count, dtype);
  int64_t chunk = gs_env_mpi_max_count();
  size_t es = gs_dtype_size(dtype);
  int in_place = c->rank == root && send == recv;
  for (int64_t off = 0; off < count; off += chunk) {
    int k = (int)(count - off < chunk ? count - off : chunk);
    const void *s = in_place ? MPI_IN_PLACE : (const char *)send + (size_t)off * es;
    void *r = c->rank == root ? (char *)recv + (size_t)off * es : NULL;
    MPI_Request req;
    GS_CHECK(gs_mpi_finish(MPI_Ireduce(s, r, k, dt, mop, root, c->mpi, &req), &req,
                           "gs_reduce: MPI_Ireduce"));
  }
  return GS_SUCCESS;
}
