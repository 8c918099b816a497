/* Host MPI for the exchange collectives: MPI's own alltoallv, gatherv,
 * scatterv and reduce (nonblocking, so waits time out and yield). Every
 * wait is gs_mpi_wait. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "transport/mpi/gs_mpi_transport.h"

/* counts and displacements as ints (the caller checked that they fit). */
static int *int_copy(const int64_t *a, const int64_t *b, int p) {
  int *v = malloc(2 * (size_t)(p > 0 ? p : 1) * sizeof *v);
  for (int r = 0; v && r < p; r++) {
    v[r] = a ? (int)a[r] : 0;
    v[p + r] = b ? (int)b[r] : 0;
  }
  return v;
}

/* Elements from the start of a per-rank layout to the end of its last block
 * (0 without one). */
static int64_t extent(const int64_t *counts, const int64_t *displs, int p) {
  int64_t end = 0;
  for (int r = 0; counts && r < p; r++)
    if (counts[r] > 0 && displs[r] + counts[r] > end) end = displs[r] + counts[r];
  return end;
}

/* y: x with send (sext elements) and recv (rext) moved into the bounce
 * buffer (owned.c), unless both are the communicator's already. */
static gs_status_t bounce_in(gs_comm_t c, const gs_xfer_t *x, int64_t sext, int64_t rext,
                             gs_xfer_t *y) {
  size_t es = gs_dtype_size(x->dtype), sb = (size_t)sext * es, rb = (size_t)rext * es;
  *y = *x;
  if (gs_mpi_owned(c, x->send, sb) && gs_mpi_owned(c, x->recv, rb)) return GS_SUCCESS;
  size_t at = (sb + 63) / 64 * 64;
  char *b = NULL;
  GS_CHECK(gs_bounce_reserve(c, at + rb, (void **)&b));
  if (sb) y->send = memcpy(b, x->send, sb);
  if (rb) y->recv = b + at;
  return GS_SUCCESS;
}

/* The received blocks back to the caller's memory (nothing when y did not
 * move); counts NULL: one block of `count` elements. */
static void bounce_out(const gs_xfer_t *x, const gs_xfer_t *y, const int64_t *counts,
                       const int64_t *displs, int p, int64_t count) {
  if (y->recv == x->recv) return;
  size_t es = gs_dtype_size(x->dtype);
  if (!counts) memcpy(x->recv, y->recv, (size_t)count * es);
  for (int r = 0; counts && r < p; r++)
    if (counts[r] > 0)
      memcpy((char *)x->recv + (size_t)displs[r] * es, (char *)y->recv + (size_t)displs[r] * es,
             (size_t)counts[r] * es);
}

static gs_status_t alltoallv_at(gs_comm_t c, const gs_xfer_t *x);
static gs_status_t gatherv_at(gs_comm_t c, const gs_xfer_t *x);
static gs_status_t scatterv_at(gs_comm_t c, const gs_xfer_t *x);

gs_status_t gs_mpi_alltoallv(gs_comm_t c, const gs_xfer_t *x) {
  int p = c->size;
  gs_xfer_t y;
  GS_CHECK(
      bounce_in(c, x, extent(x->scounts, x->sdispls, p), extent(x->rcounts, x->rdispls, p), &y));
  GS_CHECK(alltoallv_at(c, &y));
  bounce_out(x, &y, x->rcounts, x->rdispls, p, 0);
  return GS_SUCCESS;
}

gs_status_t gs_mpi_gatherv(gs_comm_t c, const gs_xfer_t *x) {
  int p = c->size, root = c->rank == x->root;
  gs_xfer_t y;
  GS_CHECK(bounce_in(c, x, x->scount, root ? extent(x->rcounts, x->rdispls, p) : 0, &y));
  GS_CHECK(gatherv_at(c, &y));
  if (root) bounce_out(x, &y, x->rcounts, x->rdispls, p, 0);
  return GS_SUCCESS;
}

gs_status_t gs_mpi_scatterv(gs_comm_t c, const gs_xfer_t *x) {
  int p = c->size, root = c->rank == x->root;
  gs_xfer_t y;
  GS_CHECK(bounce_in(c, x, root ? extent(x->scounts, x->sdispls, p) : 0, x->rcount, &y));
  GS_CHECK(scatterv_at(c, &y));
  bounce_out(x, &y, NULL, NULL, p, x->rcount);
  return GS_SUCCESS;
}

static gs_status_t alltoallv_at(gs_comm_t c, const gs_xfer_t *x) {
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

static gs_status_t gatherv_at(gs_comm_t c, const gs_xfer_t *x) {
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

static gs_status_t scatterv_at(gs_comm_t c, const gs_xfer_t *x) {
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

static gs_status_t reduce_at(gs_comm_t c, const void *send, void *recv, int64_t count,
                             gs_dtype_t dtype, gs_op_t op, int root);

/* Through the bounce buffer unless both sides are the communicator's; in
 * place at the root stays in place. */
gs_status_t gs_mpi_reduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                          gs_dtype_t dtype, gs_op_t op, int root) {
  size_t bytes = (size_t)count * gs_dtype_size(dtype), at = (bytes + 63) / 64 * 64;
  int me = c->rank == root, in_place = me && send == recv;
  if (gs_mpi_owned(c, send, bytes) && (!me || gs_mpi_owned(c, recv, bytes)))
    return reduce_at(c, send, recv, count, dtype, op, root);
  char *b = NULL;
  GS_CHECK(gs_bounce_reserve(c, at + (me ? bytes : 0), (void **)&b));
  if (bytes) memcpy(b, send, bytes);
  char *r = in_place ? b : b + at;
  GS_CHECK(reduce_at(c, b, me ? r : NULL, count, dtype, op, root));
  if (me && bytes) memcpy(recv, r, bytes);
  return GS_SUCCESS;
}

static gs_status_t reduce_at(gs_comm_t c, const void *send, void *recv, int64_t count,
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
