/* Where the exchange collectives' data goes, by memory:
 *
 *   host memory        MPI's own collective while counts fit int (x->native),
 *                      else pairwise exchanges in chunks (the transport's exchange)
 *   CUDA, NCCL path    alltoallv: every send and receive in one NCCL group;
 *                      gatherv, scatterv: pairwise NCCL send/recv, all on
 *                      gradsync's stream
 *   CUDA-aware MPI     the host algorithm on the device pointers, once the
 *                      stream has drained
 *   CUDA, staged       the host algorithm on pinned copies
 *
 * Pairwise rounds: in round k every rank pairs with (k - rank) mod size, an
 * involution, so each exchange has both of its ends in the same round; the
 * rank paired with itself copies locally. reduce needs no new transport
 * entry: on a device it is the transport's reduce_scatter with every block
 * empty but the root's. */
#include <stdlib.h>

#include "algorithms/gs_algorithms.h"

static gs_status_t local_copy(const gs_engine_t *e, gs_dtype_t dtype, void *dst, const void *src,
                              int64_t count) {
  gs_copy_t one = {dst, src, count};
  return count ? gs_copy_batch(e, dtype, &one, 1, 1.0) : GS_SUCCESS;
}

static size_t bytes_at(const gs_xfer_t *x, int64_t elems) {
  return (size_t)elems * gs_dtype_size(x->dtype);
}

static gs_status_t pairwise_alltoallv(const gs_engine_t *e, gs_exchange_fn exch,
                                      const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  int me = c->rank, p = c->size;
  for (int k = 0; k < p; k++) {
    int peer = ((k - me) % p + p) % p;
    const void *s = gs_at(x->send, bytes_at(x, x->sdispls[peer]));
    void *r = gs_at(x->recv, bytes_at(x, x->rdispls[peer]));
    if (peer == me) GS_CHECK(local_copy(e, x->dtype, r, s, x->scounts[me]));
    else GS_CHECK(exch(c, s, x->scounts[peer], r, x->rcounts[peer], x->dtype, peer));
  }
  return GS_SUCCESS;
}

/* Every peer at once through the transport (NCCL: one group), the own
 * block copied here. */
static gs_status_t grouped_alltoallv(const gs_engine_t *e, const gs_xfer_t *x) {
  int me = e->comm->rank;
  GS_CHECK(local_copy(e, x->dtype, gs_at(x->recv, bytes_at(x, x->rdispls[me])),
                      gs_at(x->send, bytes_at(x, x->sdispls[me])), x->scounts[me]));
  return e->transport->alltoallv(e->comm, x->send, x->scounts, x->sdispls, x->recv, x->rcounts,
                                 x->rdispls, x->dtype);
}

static gs_status_t pairwise_gatherv(const gs_engine_t *e, gs_exchange_fn exch, const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  if (c->rank != x->root) return exch(c, x->send, x->scount, NULL, 0, x->dtype, x->root);
  for (int r = 0; r < c->size; r++) {
    void *dst = gs_at(x->recv, bytes_at(x, x->rdispls[r]));
    if (r == c->rank) GS_CHECK(local_copy(e, x->dtype, dst, x->send, x->rcounts[r]));
    else GS_CHECK(exch(c, NULL, 0, dst, x->rcounts[r], x->dtype, r));
  }
  return GS_SUCCESS;
}

static gs_status_t pairwise_scatterv(const gs_engine_t *e, gs_exchange_fn exch,
                                     const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  if (c->rank != x->root) return exch(c, NULL, 0, x->recv, x->rcount, x->dtype, x->root);
  for (int r = 0; r < c->size; r++) {
    const void *src = gs_at(x->send, bytes_at(x, x->sdispls[r]));
    if (r == c->rank) GS_CHECK(local_copy(e, x->dtype, x->recv, src, x->scounts[r]));
    else GS_CHECK(exch(c, src, x->scounts[r], NULL, 0, x->dtype, r));
  }
  return GS_SUCCESS;
}

typedef enum { KIND_ALLTOALLV, KIND_GATHERV, KIND_SCATTERV } kind_t;

/* The host algorithm: MPI's collective or pairwise exchanges through `exch`. */
static gs_status_t host_run(const gs_engine_t *e, kind_t kind, gs_exchange_fn exch,
                            const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  switch (kind) {
    case KIND_ALLTOALLV: return x->native ? gs_mpi_alltoallv(c, x) : pairwise_alltoallv(e, exch, x);
    case KIND_GATHERV: return x->native ? gs_mpi_gatherv(c, x) : pairwise_gatherv(e, exch, x);
    case KIND_SCATTERV: return x->native ? gs_mpi_scatterv(c, x) : pairwise_scatterv(e, exch, x);
  }
  return gs_fail(GS_ERR_INTERNAL, "xfer: unknown kind %d", (int)kind);
}

/* Elements this rank sends and receives in total, and where they sit. */
static void totals(gs_comm_t c, kind_t kind, const gs_xfer_t *x, int64_t *sent, int64_t *received) {
  int root = c->rank == x->root;
  *sent = *received = 0;
  if (kind == KIND_GATHERV) {
    *sent = x->scount;
    for (int r = 0; root && r < c->size; r++) *received += x->rcounts[r];
  } else if (kind == KIND_SCATTERV) {
    *received = x->rcount;
    for (int r = 0; root && r < c->size; r++) *sent += x->scounts[r];
  } else {
    for (int r = 0; r < c->size; r++) {
      *sent += x->scounts[r];
      *received += x->rcounts[r];
    }
  }
}

/* Elements from the buffer's start to the end of its last block. */
static int64_t extent(const int64_t *counts, const int64_t *displs, int p) {
  int64_t end = 0;
  for (int r = 0; r < p; r++)
    if (counts[r] && displs[r] + counts[r] > end) end = displs[r] + counts[r];
  return end;
}

/* How far into send and recv the blocks reach (blocks may repeat or leave
 * gaps: the wire allreduce sends one block to every peer). */
static void extents(gs_comm_t c, kind_t kind, const gs_xfer_t *x, int64_t *sent,
                    int64_t *received) {
  int root = c->rank == x->root, p = c->size;
  *sent = *received = 0;
  if (kind == KIND_GATHERV) {
    *sent = x->scount;
    if (root) *received = extent(x->rcounts, x->rdispls, p);
  } else if (kind == KIND_SCATTERV) {
    *received = x->rcount;
    if (root) *sent = extent(x->scounts, x->sdispls, p);
  } else {
    *sent = extent(x->scounts, x->sdispls, p);
    *received = extent(x->rcounts, x->rdispls, p);
  }
}

/* Device memory through pinned host copies: inputs down, the host algorithm
 * on the copies, outputs up (each buffer's span of blocks, offsets kept). */
static gs_status_t staged_run(const gs_engine_t *e, kind_t kind, const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  int64_t sent, received;
  extents(c, kind, x, &sent, &received);
  size_t sbytes = (bytes_at(x, sent) + 63) & ~(size_t)63;
  GS_CHECK(gs_cu_grow_pinned(&c->pinned, &c->pinned_bytes, sbytes + bytes_at(x, received) + 64,
                             e->stream));
  gs_xfer_t h = *x;
  h.send = c->pinned;
  h.recv = (char *)c->pinned + sbytes;
  if (sent) GS_CHECK(gs_cu_copy((void *)h.send, x->send, bytes_at(x, sent), e->stream));
  GS_CHECK(gs_cu_stream_wait(e->stream, "gradsync: staging device memory through the host"));
  gs_engine_t host = {
      .comm = c, .call = e->call, .device = -1, .stream = NULL, .transport = &gs_mpi_transport};
  GS_CHECK(host_run(&host, kind, gs_mpi_transport.exchange, &h));
  if (received) GS_CHECK(gs_cu_copy(x->recv, h.recv, bytes_at(x, received), e->stream));
  return gs_cu_stream_wait(e->stream, "gradsync: staging device memory through the host");
}

static gs_status_t run(const gs_engine_t *e, kind_t kind, const gs_xfer_t *x) {
  gs_comm_t c = e->comm;
  double t0 = GS_TL_START();
  gs_status_t s;
  if (!gs_engine_on_device(e)) {
    s = host_run(e, kind, e->transport->exchange, x);
  } else if (c->dev_path == GS_PATH_NCCL && kind == KIND_ALLTOALLV && e->transport->alltoallv) {
    s = grouped_alltoallv(e, x);
  } else if (c->dev_path == GS_PATH_NCCL) {
    gs_xfer_t pairwise = *x; /* NCCL has no gatherv/scatterv of its own */
    pairwise.native = 0;
    s = host_run(e, kind, e->transport->exchange, &pairwise);
  } else if (c->dev_path == GS_PATH_CUDA_AWARE) {
    s = gs_cu_stream_wait(e->stream, "gradsync: before CUDA-aware MPI");
    if (s == GS_SUCCESS) s = host_run(e, kind, e->transport->exchange, x);
  } else {
    s = staged_run(e, kind, x);
  }
  int64_t sent, received;
  totals(c, kind, x, &sent, &received);
  GS_TL_END("communicate", e->call, 1, t0, (int64_t)bytes_at(x, sent + received));
  return s;
}

gs_status_t gs_xfer_alltoallv(const gs_engine_t *e, const gs_xfer_t *x) {
  return run(e, KIND_ALLTOALLV, x);
}

gs_status_t gs_xfer_gatherv(const gs_engine_t *e, const gs_xfer_t *x) {
  return run(e, KIND_GATHERV, x);
}

gs_status_t gs_xfer_scatterv(const gs_engine_t *e, const gs_xfer_t *x) {
  return run(e, KIND_SCATTERV, x);
}

gs_status_t gs_xfer_reduce(const gs_engine_t *e, const void *send, void *recv, int64_t count,
                           gs_dtype_t dtype, gs_op_t op, int root) {
  gs_comm_t c = e->comm;
  double t0 = GS_TL_START();
  gs_status_t s;
  if (!gs_engine_on_device(e)) {
    s = gs_mpi_reduce(c, send, recv, count, dtype, op, root);
  } else {
    int64_t *counts = calloc((size_t)c->size, sizeof *counts);
    if (!counts) return gs_fail(GS_ERR_NO_MEMORY, "gs_reduce: out of memory");
    counts[root] = count;
    void *none = recv; /* a rank's empty block still needs memory MPI sees as unaliased */
    s = c->rank == root ? GS_SUCCESS : gs_scratch_reserve(e, 64, &none);
    if (s == GS_SUCCESS) s = e->transport->reduce_scatter(c, send, none, counts, dtype, op);
    free(counts);
  }
  GS_TL_END("communicate", e->call, 1, t0, count * (int64_t)gs_dtype_size(dtype));
  return s;
}
