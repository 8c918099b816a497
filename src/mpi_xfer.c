/* Host MPI for the exchange collectives: MPI's own alltoallv, gatherv,
 * scatterv and reduce (nonblocking, so waits time out and yield), a chunked
 * pairwise exchange for counts past MPI's int, and the one-message derived
 * datatype point-to-point messages use. Every wait is gs_mpi_wait. */
#include <limits.h>
#include <stdlib.h>

#include "gs_internal.h"

#define XCHG_TAG 0x7867

uint64_t gs_hash_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

static void count_message(gs_comm_t c, int64_t count, gs_dtype_t dtype) {
  c->stats.messages++;
  c->stats.bytes += (uint64_t)count * gs_dtype_size(dtype);
}

/* counts and displacements as ints (the caller checked that they fit). */
static int *int_copy(const int64_t *a, const int64_t *b, int p) {
  int *v = malloc(2 * (size_t)(p > 0 ? p : 1) * sizeof *v);
  for (int r = 0; v && r < p; r++) {
    v[r] = a ? (int)a[r] : 0;
    v[p + r] = b ? (int)b[r] : 0;
  }
  return v;
}

static gs_status_t finish(int e, MPI_Request *req, const char *what) {
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, what);
  return gs_mpi_wait(req, what, NULL, NULL);
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
    count_message(c, total, x->dtype);
    MPI_Request req;
    st = finish(MPI_Ialltoallv(x->send, s, s + p, dt, x->recv, r, r + p, dt, c->mpi, &req), &req,
                "gs_alltoallv: MPI_Ialltoallv");
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
  count_message(c, x->scount, x->dtype);
  MPI_Request req;
  gs_status_t st = finish(MPI_Igatherv(x->send, (int)x->scount, dt, x->recv, r, r ? r + p : NULL,
                                       dt, x->root, c->mpi, &req),
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
  count_message(c, x->rcount, x->dtype);
  MPI_Request req;
  gs_status_t st = finish(MPI_Iscatterv(x->send, s, s ? s + p : NULL, dt, x->recv, (int)x->rcount,
                                        dt, x->root, c->mpi, &req),
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
  count_message(c, count, dtype);
  int64_t chunk = gs_env_mpi_max_count();
  size_t es = gs_dtype_size(dtype);
  int in_place = c->rank == root && send == recv;
  for (int64_t off = 0; off < count; off += chunk) {
    int k = (int)(count - off < chunk ? count - off : chunk);
    const void *s = in_place ? MPI_IN_PLACE : (const char *)send + (size_t)off * es;
    void *r = c->rank == root ? (char *)recv + (size_t)off * es : NULL;
    MPI_Request req;
    GS_CHECK(finish(MPI_Ireduce(s, r, k, dt, mop, root, c->mpi, &req), &req,
                    "gs_reduce: MPI_Ireduce"));
  }
  return GS_SUCCESS;
}

gs_status_t gs_mpi_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                            int64_t rcount, gs_dtype_t dtype, int peer) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  int64_t chunk = gs_env_mpi_max_count();
  if (scount) count_message(c, scount, dtype);
  for (int64_t off = 0; off < scount || off < rcount; off += chunk) {
    int sn = (int)(scount - off > chunk ? chunk : (scount > off ? scount - off : 0));
    int rn = (int)(rcount - off > chunk ? chunk : (rcount > off ? rcount - off : 0));
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (rn)
      GS_MPI_CHECK(MPI_Irecv((char *)rbuf + (size_t)off * es, rn, dt, peer, XCHG_TAG, c->mpi,
                             &req[0]), "exchange: MPI_Irecv");
    if (sn)
      GS_MPI_CHECK(MPI_Isend((const char *)sbuf + (size_t)off * es, sn, dt, peer, XCHG_TAG,
                             c->mpi, &req[1]), "exchange: MPI_Isend");
    for (int k = 0; k < 2; k++)
      if (req[k] != MPI_REQUEST_NULL)
        GS_CHECK(gs_mpi_wait(&req[k], k ? "exchange: send" : "exchange: receive", NULL, NULL));
  }
  return GS_SUCCESS;
}

gs_status_t gs_mpi_big_type(gs_dtype_t dtype, int64_t count, MPI_Datatype *type, int *n,
                            int *derived) {
  MPI_Datatype base;
  GS_CHECK(gs_mpi_datatype(dtype, &base));
  int64_t chunk = gs_env_mpi_max_count();
  *derived = 0;
  if (count <= chunk) {
    *type = base;
    *n = (int)count;
    return GS_SUCCESS;
  }
  /* q blocks of `chunk` elements, then the rest: one element of a struct */
  int64_t q = count / chunk, rest = count % chunk;
  if (q > INT_MAX)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%lld elements are too many for one message",
                   (long long)count);
  MPI_Datatype block, whole;
  GS_MPI_CHECK(MPI_Type_contiguous((int)chunk, base, &block), "MPI_Type_contiguous");
  int blens[2] = {(int)q, (int)rest};
  MPI_Aint displs[2] = {0, (MPI_Aint)(q * chunk * (int64_t)gs_dtype_size(dtype))};
  MPI_Datatype types[2] = {block, base};
  int e = MPI_Type_create_struct(rest ? 2 : 1, blens, displs, types, &whole);
  MPI_Type_free(&block);
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "MPI_Type_create_struct");
  e = MPI_Type_commit(&whole);
  if (e != MPI_SUCCESS) {
    MPI_Type_free(&whole);
    return gs_mpi_fail(e, "MPI_Type_commit");
  }
  *type = whole;
  *n = 1;
  *derived = 1;
  return GS_SUCCESS;
}
