/* MPI on device buffers, for MPI libraries that cannot read GPU memory (the
 * mpich wheel among them): data goes through pinned host memory on gradsync's
 * stream and the MPI transport runs on the host copy. Allreduce, the
 * bandwidth-critical one, is pipelined in chunks: while MPI reduces chunk k,
 * chunk k-1 goes back up and chunk k+1 comes down. */
#include <stdlib.h>

#include "transport/mpi/gs_mpi_transport.h"

static gs_status_t pinned(gs_comm_t c, size_t bytes, void **buf) {
  GS_CHECK(gs_cu_grow_pinned(&c->pinned, &c->pinned_bytes, bytes, c->dev_stream));
  *buf = c->pinned;
  return GS_SUCCESS;
}

static gs_status_t down(gs_comm_t c, void *host, const void *dev, size_t bytes) {
  return gs_cu_copy(host, dev, bytes, c->dev_stream);
}

static gs_status_t up(gs_comm_t c, void *dev, const void *host, size_t bytes) {
  return gs_cu_copy(dev, host, bytes, c->dev_stream);
}

/* The host reads or reuses pinned memory only after the copies into or out
 * of it finished: a polling wait, so it times out and can be interrupted. */
static gs_status_t wait_copies(gs_comm_t c) {
  return gs_cu_stream_wait(c->dev_stream, "gradsync: staging device memory through the host");
}

static gs_status_t staged_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op) {
  if (count == 0) return GS_SUCCESS;
  size_t es = gs_dtype_size(dtype);
  int64_t chunk_bytes = gs_env_stage_chunk_bytes() / 64 * 64; /* aligned halves */
  int64_t per = chunk_bytes / (int64_t)es;
  int64_t nchunks = (count + per - 1) / per;
  const char *src = send ? send : recv;
  char *host[2];
  void *pin;
  GS_CHECK(pinned(c, 2 * (size_t)chunk_bytes, &pin));
  host[0] = pin;
  host[1] = (char *)pin + chunk_bytes;
  MPI_Datatype dt;
  MPI_Op mop;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
#define CHUNK_AT(k) ((k) * per)
#define CHUNK_LEN(k) ((k) == nchunks - 1 ? count - (k) * per : per)
  GS_CHECK(down(c, host[0], src, (size_t)CHUNK_LEN(0) * es));
  GS_CHECK(wait_copies(c));
  for (int64_t k = 0; k < nchunks; k++) {
    MPI_Request req = MPI_REQUEST_NULL;
    /* inside one host the peers read the chunk where it lies (cma.c), on
     * this thread, while the copies below run on the stream */
    int direct = gs_cma_wanted(c, CHUNK_LEN(k) * (int64_t)es);
    int e = direct ? MPI_SUCCESS
                   : MPI_Iallreduce(MPI_IN_PLACE, host[k % 2], (int)CHUNK_LEN(k), dt, mop, c->mpi,
                                    &req);
    if (e != MPI_SUCCESS) return gs_mpi_fail(e, "gradsync: staged MPI_Iallreduce");
    /* meanwhile: chunk k-1 back to the device, then chunk k+1 into its buffer */
    if (k > 0)
      GS_CHECK(up(c, (char *)recv + (size_t)CHUNK_AT(k - 1) * es, host[(k - 1) % 2],
                  (size_t)CHUNK_LEN(k - 1) * es));
    if (k + 1 < nchunks)
      GS_CHECK(down(c, host[(k + 1) % 2], src + (size_t)CHUNK_AT(k + 1) * es,
                    (size_t)CHUNK_LEN(k + 1) * es));
    if (direct) GS_CHECK(gs_mpi_transport.allreduce(c, NULL, host[k % 2], CHUNK_LEN(k), dtype, op));
    else GS_CHECK(gs_mpi_wait(&req, "staged allreduce", NULL, NULL));
    GS_CHECK(wait_copies(c));
  }
  GS_CHECK(up(c, (char *)recv + (size_t)CHUNK_AT(nchunks - 1) * es, host[(nchunks - 1) % 2],
              (size_t)CHUNK_LEN(nchunks - 1) * es));
#undef CHUNK_AT
#undef CHUNK_LEN
  return wait_copies(c); /* the pinned buffers are free again */
}

static gs_status_t staged_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                    int root) {
  size_t bytes = (size_t)count * gs_dtype_size(dtype);
  void *host;
  GS_CHECK(pinned(c, bytes, &host));
  if (c->rank == root) {
    GS_CHECK(down(c, host, buf, bytes));
    GS_CHECK(wait_copies(c));
  }
  GS_CHECK(gs_mpi_transport.broadcast(c, host, count, dtype, root));
  if (c->rank != root) GS_CHECK(up(c, buf, host, bytes));
  return wait_copies(c);
}

static gs_status_t staged_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                     const int64_t *displs, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  int64_t end = 0;
  for (int r = 0; r < c->size; r++)
    if (displs[r] + counts[r] > end) end = displs[r] + counts[r];
  char *host;
  GS_CHECK(pinned(c, (size_t)end * es, (void **)&host));
  size_t mine = (size_t)displs[c->rank] * es;
  GS_CHECK(down(c, host + mine, (char *)recv + mine, (size_t)counts[c->rank] * es));
  GS_CHECK(wait_copies(c));
  GS_CHECK(gs_mpi_transport.allgatherv(c, host, counts, displs, dtype));
  for (int r = 0; r < c->size; r++)
    if (r != c->rank && counts[r])
      GS_CHECK(up(c, (char *)recv + (size_t)displs[r] * es, host + (size_t)displs[r] * es,
                  (size_t)counts[r] * es));
  return wait_copies(c);
}

static gs_status_t staged_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                         const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  size_t es = gs_dtype_size(dtype);
  int64_t total = 0;
  for (int r = 0; r < c->size; r++) total += counts[r];
  char *host;
  GS_CHECK(pinned(c, (size_t)(total + counts[c->rank]) * es, (void **)&host));
  char *hrecv = host + (size_t)total * es;
  GS_CHECK(down(c, host, send, (size_t)total * es));
  GS_CHECK(wait_copies(c));
  GS_CHECK(gs_mpi_transport.reduce_scatter(c, host, hrecv, counts, dtype, op));
  GS_CHECK(up(c, recv, hrecv, (size_t)counts[c->rank] * es));
  return wait_copies(c);
}

/* A pairwise exchange, staged: what goes out comes down first. */
static gs_status_t staged_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                   int64_t rcount, gs_dtype_t dtype, int peer) {
  size_t es = gs_dtype_size(dtype);
  char *host;
  GS_CHECK(pinned(c, (size_t)(scount + rcount) * es, (void **)&host));
  char *hrecv = host + (size_t)scount * es;
  if (scount) {
    GS_CHECK(down(c, host, sbuf, (size_t)scount * es));
    GS_CHECK(wait_copies(c));
  }
  GS_CHECK(gs_mpi_transport.exchange(c, host, scount, hrecv, rcount, dtype, peer));
  if (rcount) GS_CHECK(up(c, rbuf, hrecv, (size_t)rcount * es));
  return wait_copies(c);
}

/* The work of a device path that ends on the host side: an event is all
 * there is to poll (the CUDA-aware path shares it). */
static int staged_poll(gs_comm_t c, void *event, const char *what, gs_status_t *err) {
  (void)c;
  int r = gs_cu_event_poll(event, what);
  if (r < 0) *err = GS_ERR_CUDA;
  return r;
}

const gs_transport_t gs_staged_transport = {
    .name = "mpi-staged",
    .allreduce = staged_allreduce,
    .broadcast = staged_broadcast,
    .allgatherv = staged_allgatherv,
    .reduce_scatter = staged_reduce_scatter,
    .exchange = staged_exchange,
    .poll = staged_poll,
};
