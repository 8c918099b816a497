/* The MPI transport: host memory, 64-bit counts split into chunks MPI's
 * int counts can carry, small allreduces by recursive doubling, large ones
 * across hosts by the hierarchical algorithm, inside one host by reading
 * the peers' memory; which of them moves a message is its route, decided
 * once (mpi_route). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "transport/mpi/gs_mpi_transport.h"

/* Elements per MPI call. A power of two well below INT_MAX keeps every chunk
 * and byte offset of 8-byte types inside int. */
#define GS_MPI_CHUNK ((int64_t)1 << 30)
#define XCHG_TAG 0x7867

/* One transport call is one fused message, however many chunks MPI needs. */
#define RD_TAG 0x6772
#define RD_MAX_BYTES GS_BLOCKING_MAX_BYTES

typedef struct small {
  gs_comm_t c;
  int bytes;
  int64_t count;
  gs_dtype_t dtype;
  gs_op_t op;
} small_t;

static gs_status_t small_swap(void *ctx, const void *send, void *recv, int peer) {
  small_t *a = ctx;
  MPI_Request r = MPI_REQUEST_NULL, s = MPI_REQUEST_NULL;
  if (recv)
    GS_MPI_CHECK(MPI_Irecv(recv, a->bytes, MPI_BYTE, peer, RD_TAG, a->c->mpi, &r), "MPI_Irecv");
  if (send)
    GS_MPI_CHECK(MPI_Isend(send, a->bytes, MPI_BYTE, peer, RD_TAG, a->c->mpi, &s), "MPI_Isend");
  if (recv) GS_CHECK(gs_mpi_wait(&r, "allreduce receive", NULL, NULL));
  if (send) GS_CHECK(gs_mpi_wait(&s, "allreduce send", NULL, NULL));
  return GS_SUCCESS;
}

/* gs_cpu_reduce reduces into its second argument: the upper one. */
static gs_status_t small_combine(void *ctx, const void *lower, const void *upper, void *out) {
  small_t *a = ctx;
  gs_cpu_reduce(a->dtype, a->op, lower, (void *)upper, a->count);
  if (out != upper) memcpy(out, upper, (size_t)a->bytes);
  return GS_SUCCESS;
}

/* Small allreduces by recursive doubling (rdouble.c): as fast as a blocking
 * MPI_Allreduce (MPICH's MPI_Iallreduce costs about twice as much at 4-64
 * KiB), while it can time out, be interrupted and let other threads in. */
static gs_status_t rd_allreduce(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                gs_op_t op) {
  static _Thread_local unsigned char other[RD_MAX_BYTES] __attribute__((aligned(64)));
  small_t a = {c, (int)(count * (int64_t)gs_dtype_size(dtype)), count, dtype, op};
  gs_rd_t rd = {c->rank, c->size, small_swap, small_combine, NULL, &a};
  return gs_rdouble(&rd, buf, other);
}

/* The flat path: small messages by recursive doubling, the rest by MPI's
 * own allreduce (a size within the path, decided per piece). */
static gs_status_t flat_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                  gs_dtype_t dtype, gs_op_t op) {
  int64_t bytes = count * (int64_t)gs_dtype_size(dtype);
  if (bytes <= RD_MAX_BYTES && !gs_use_blocking(c, bytes)) {
    if (send) memcpy(recv, send, (size_t)bytes);
    return rd_allreduce(c, recv, count, dtype, op);
  }
  return gs_mpi_native_allreduce(c, send, recv, count, dtype, op);
}

/* The flat path where the host's ranks read each other's memory (cma.c):
 * a piece from the threshold up is read so (the probe at the first), the
 * others, and every piece after a refusal, go flat. */
static gs_status_t flat_read_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                       gs_dtype_t dtype, gs_op_t op) {
  if (gs_cma_reads(c, count * (int64_t)gs_dtype_size(dtype))) {
    gs_seg_t in = {(void *)send, count}, out = {recv, count};
    int taken = 0;
    GS_CHECK(gs_cma_allreduce(c, send ? &in : NULL, &out, 1, dtype, op, 1.0, 1.0, &taken));
    if (taken) return GS_SUCCESS;
  }
  return flat_allreduce(c, send, recv, count, dtype, op);
}

static gs_status_t flat_wire_allreduce(gs_comm_t c, float *x, int64_t count, gs_wire_t wire,
                                       double post, float *lost, const gs_wire_hooks_t *hooks) {
  return gs_wire_allreduce(c, c->mpi, x, count, wire, post, lost, hooks);
}

/* The table's route: the hierarchical predicate asked once for the message
 * (and once for its run when that is longer), the peer reads from the
 * thresholds and the probe's answer so far. The hierarchical path wants
 * the message whole (it pipelines its own segments); the flat one goes in
 * pieces of the communicator's pipeline size, in multiples of 64 bytes.
 * The hierarchical predicate grows with the bytes, so the pieces of a
 * message it declined are declined too: never asked again per piece. */
static gs_status_t mpi_route(gs_comm_t c, gs_dtype_t dtype, int64_t count, int64_t run_count,
                             int64_t run_nseg, gs_route_t *r) {
  int64_t es = (int64_t)gs_dtype_size(dtype), bytes = count * es, run = run_count * es;
  int64_t pipeline = c->pipeline_bytes / 64 * 64;
  int hier = gs_hier_wanted(c, bytes);
  *r = (gs_route_t){.run = hier ? gs_hier_allreduce : flat_allreduce,
                    .wire = hier ? gs_hier_wire_allreduce : flat_wire_allreduce,
                    .wire_segments = hier};
  if (!hier && gs_cma_reads(c, c->cma_bytes)) r->run = flat_read_allreduce;
  if (!hier && pipeline > 0 && bytes > pipeline) r->piece = pipeline / es;
  /* the run where it lies, read by the peers; a refusal at the probe
   * leaves it to r->run (allreduce_segments declines) */
  if (run_nseg > 0 && 2 * run_nseg <= INT32_MAX && gs_cma_reads(c, run))
    r->segments = run == bytes ? !hier : !gs_hier_wanted(c, run);
  return GS_SUCCESS;
}

/* One buffer, whole, by its route (staged.c's chunks, any caller outside
 * the fusion engine's messages). */
static gs_status_t mpi_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                 gs_dtype_t dtype, gs_op_t op) {
  gs_route_t r;
  GS_CHECK(mpi_route(c, dtype, count, 0, 0, &r));
  return r.run(c, send, recv, count, dtype, op);
}

gs_status_t gs_mpi_native_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  size_t es = gs_dtype_size(dtype);
  for (int64_t off = 0; off < count; off += GS_MPI_CHUNK) {
    int n = (int)(count - off < GS_MPI_CHUNK ? count - off : GS_MPI_CHUNK);
    char *r = (char *)recv + (size_t)off * es;
    const void *s = send ? (const char *)send + (size_t)off * es : MPI_IN_PLACE;
    MPI_Request req;
    if (gs_use_blocking(c, (int64_t)n * (int64_t)es))
      GS_CHECK(gs_mpi_finish(MPI_Allreduce(s, r, n, dt, mop, c->mpi), NULL, "MPI_Allreduce"));
    else
      GS_CHECK(
          gs_mpi_finish(MPI_Iallreduce(s, r, n, dt, mop, c->mpi, &req), &req, "MPI_Iallreduce"));
  }
  return GS_SUCCESS;
}

static gs_status_t chunked_bcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype, int root);

/* Elements per bounced piece of a broadcast or exchange (owned.c): the same
 * on every rank whatever memory it holds, so the messages match. */
static int64_t bounce_piece(gs_dtype_t dtype) {
  int64_t n = GS_BOUNCE_PIECE_BYTES / (int64_t)gs_dtype_size(dtype), most = gs_env_mpi_max_count();
  return n < most ? n : most;
}

static gs_status_t mpi_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                 int root) {
  gs_count_message(c, count, dtype);
  size_t es = gs_dtype_size(dtype);
  int64_t piece = bounce_piece(dtype);
  int owned = gs_mpi_owned(c, buf, (size_t)count * es);
  void *b = NULL;
  if (!owned) GS_CHECK(gs_bounce_reserve(c, (size_t)(count < piece ? count : piece) * es, &b));
  for (int64_t off = 0; off < count; off += piece) {
    int64_t n = count - off < piece ? count - off : piece;
    char *at = (char *)buf + (size_t)off * es;
    if (owned) {
      GS_CHECK(chunked_bcast(c, at, n, dtype, root));
      continue;
    }
    if (c->rank == root) memcpy(b, at, (size_t)n * es);
    GS_CHECK(chunked_bcast(c, b, n, dtype, root));
    if (c->rank != root) memcpy(at, b, (size_t)n * es);
  }
  return GS_SUCCESS;
}

static gs_status_t chunked_bcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                 int root) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  for (int64_t off = 0; off < count; off += GS_MPI_CHUNK) {
    int n = (int)(count - off < GS_MPI_CHUNK ? count - off : GS_MPI_CHUNK);
    MPI_Request req;
    char *p = (char *)buf + (size_t)off * es;
    if (gs_use_blocking(c, (int64_t)n * (int64_t)es))
      GS_CHECK(gs_mpi_finish(MPI_Bcast(p, n, dt, root, c->mpi), NULL, "broadcast: MPI_Bcast"));
    else
      GS_CHECK(
          gs_mpi_finish(MPI_Ibcast(p, n, dt, root, c->mpi, &req), &req, "broadcast: MPI_Ibcast"));
  }
  return GS_SUCCESS;
}

static int fits_int(const int64_t *v, int n) {
  for (int i = 0; i < n; i++)
    if (v[i] > INT_MAX) return 0;
  return 1;
}

/* Elements from the start of a per-rank layout to the end of its last block. */
static int64_t extent(const int64_t *counts, const int64_t *displs, int p) {
  int64_t end = 0;
  for (int r = 0; r < p; r++)
    if (counts[r] > 0 && displs[r] + counts[r] > end) end = displs[r] + counts[r];
  return end;
}

static gs_status_t allgatherv_at(gs_comm_t c, void *recv, const int64_t *counts,
                                 const int64_t *displs, gs_dtype_t dtype);

/* In the bounce buffer unless recv is the communicator's (owned.c). */
static gs_status_t mpi_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                  const int64_t *displs, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  int p = c->size, me = c->rank;
  size_t bytes = (size_t)extent(counts, displs, p) * es;
  int taken = 0;
  if (gs_cma_wanted(c, (int64_t)bytes)) /* inside one host: read where it lies */
    GS_CHECK(gs_cma_allgatherv(c, recv, counts, displs, dtype, &taken));
  if (taken) {
    gs_count_message(c, displs[p - 1] + counts[p - 1], dtype);
    return GS_SUCCESS;
  }
  if (gs_mpi_owned(c, recv, bytes)) return allgatherv_at(c, recv, counts, displs, dtype);
  char *b = NULL;
  GS_CHECK(gs_bounce_reserve(c, bytes, (void **)&b));
  if (counts[me] > 0)
    memcpy(b + displs[me] * es, (char *)recv + displs[me] * es, (size_t)counts[me] * es);
  GS_CHECK(allgatherv_at(c, b, counts, displs, dtype));
  for (int r = 0; r < p; r++)
    if (r != me && counts[r] > 0)
      memcpy((char *)recv + displs[r] * es, b + displs[r] * es, (size_t)counts[r] * es);
  return GS_SUCCESS;
}

static gs_status_t allgatherv_at(gs_comm_t c, void *recv, const int64_t *counts,
                                 const int64_t *displs, gs_dtype_t dtype) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  int p = c->size;
  gs_count_message(c, displs[p - 1] + counts[p - 1], dtype);
  if (fits_int(counts, p) && fits_int(displs, p)) {
    int *ic = malloc(2 * (size_t)p * sizeof(int));
    if (!ic) return gs_fail(GS_ERR_NO_MEMORY, "allgather: out of memory");
    for (int r = 0; r < p; r++) {
      ic[r] = (int)counts[r];
      ic[p + r] = (int)displs[r];
    }
    MPI_Request req;
    gs_status_t s;
    if (gs_use_blocking(c, (displs[p - 1] + counts[p - 1]) * (int64_t)es))
      s = gs_mpi_finish(MPI_Allgatherv(MPI_IN_PLACE, 0, dt, recv, ic, ic + p, dt, c->mpi), NULL,
                        "MPI_Allgatherv");
    else
      s = gs_mpi_finish(MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, recv, ic, ic + p, dt, c->mpi, &req),
                        &req, "MPI_Iallgatherv");
    free(ic); /* only after completion: MPI reads the counts until then */
    return s;
  }
  /* Too large for int displacements: every rank broadcasts its own block. */
  for (int r = 0; r < p; r++)
    GS_CHECK(chunked_bcast(c, (char *)recv + (size_t)displs[r] * es, counts[r], dtype, r));
  return GS_SUCCESS;
}

static gs_status_t reduce_scatter_at(gs_comm_t c, const void *send, void *recv,
                                     const int64_t *counts, gs_dtype_t dtype, gs_op_t op);

/* Both sides in the bounce buffer unless they are the communicator's. */
static gs_status_t mpi_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                      const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  size_t es = gs_dtype_size(dtype);
  int64_t total = 0;
  for (int r = 0; r < c->size; r++) total += counts[r];
  size_t sbytes = (size_t)total * es, rbytes = (size_t)counts[c->rank] * es;
  int taken = 0;
  if (gs_cma_wanted(c, (int64_t)sbytes)) /* inside one host: read where it lies */
    GS_CHECK(gs_cma_reduce_scatter(c, send, recv, counts, dtype, op, &taken));
  if (taken) {
    gs_count_message(c, total, dtype);
    return GS_SUCCESS;
  }
  if (gs_mpi_owned(c, send, sbytes) && gs_mpi_owned(c, recv, rbytes))
    return reduce_scatter_at(c, send, recv, counts, dtype, op);
  size_t at = (sbytes + 63) / 64 * 64; /* the received block, 64-byte aligned */
  char *b = NULL;
  GS_CHECK(gs_bounce_reserve(c, at + rbytes, (void **)&b));
  if (sbytes) memcpy(b, send, sbytes);
  GS_CHECK(reduce_scatter_at(c, b, b + at, counts, dtype, op));
  if (rbytes) memcpy(recv, b + at, rbytes);
  return GS_SUCCESS;
}

static gs_status_t reduce_scatter_at(gs_comm_t c, const void *send, void *recv,
                                     const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  size_t es = gs_dtype_size(dtype);
  int p = c->size;
  int64_t total = 0;
  for (int r = 0; r < p; r++) total += counts[r];
  gs_count_message(c, total, dtype);
  if (fits_int(counts, p) && total <= INT_MAX) {
    int *ic = malloc((size_t)p * sizeof(int));
    if (!ic) return gs_fail(GS_ERR_NO_MEMORY, "reduce_scatter: out of memory");
    for (int r = 0; r < p; r++) ic[r] = (int)counts[r];
    MPI_Request req;
    gs_status_t s;
    if (gs_use_blocking(c, total * (int64_t)es))
      s = gs_mpi_finish(MPI_Reduce_scatter(send, recv, ic, dt, mop, c->mpi), NULL,
                        "MPI_Reduce_scatter");
    else
      s = gs_mpi_finish(MPI_Ireduce_scatter(send, recv, ic, dt, mop, c->mpi, &req), &req,
                        "MPI_Ireduce_scatter");
    free(ic);
    return s;
  }
  /* Large: reduce each rank's block to that rank, chunk by chunk. */
  int64_t displ = 0;
  for (int r = 0; r < p; r++) {
    for (int64_t off = 0; off < counts[r]; off += GS_MPI_CHUNK) {
      int n = (int)(counts[r] - off < GS_MPI_CHUNK ? counts[r] - off : GS_MPI_CHUNK);
      const char *s = (const char *)send + (size_t)(displ + off) * es;
      void *d = r == c->rank ? (char *)recv + (size_t)off * es : NULL;
      MPI_Request req;
      GS_CHECK(gs_mpi_finish(MPI_Ireduce(s, d, n, dt, mop, r, c->mpi, &req), &req,
                             "reduce: MPI_Ireduce"));
    }
    displ += counts[r];
  }
  return GS_SUCCESS;
}

/* Either side may be empty; pieces of bounce_piece elements, through the
 * bounce buffer unless both sides are the communicator's. */
static gs_status_t mpi_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                int64_t rcount, gs_dtype_t dtype, int peer) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  int64_t chunk = bounce_piece(dtype);
  char *b = NULL;
  if (!gs_mpi_owned(c, sbuf, (size_t)scount * es) || !gs_mpi_owned(c, rbuf, (size_t)rcount * es))
    GS_CHECK(gs_bounce_reserve(c, 2 * (size_t)chunk * es, (void **)&b));
  if (scount) gs_count_message(c, scount, dtype);
  for (int64_t off = 0; off < scount || off < rcount; off += chunk) {
    int sn = (int)(scount - off > chunk ? chunk : (scount > off ? scount - off : 0));
    int rn = (int)(rcount - off > chunk ? chunk : (rcount > off ? rcount - off : 0));
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const char *s = (const char *)sbuf + (size_t)off * es;
    char *r = (char *)rbuf + (size_t)off * es;
    if (b && sn) s = memcpy(b, s, (size_t)sn * es);
    char *into = b ? b + (size_t)chunk * es : r;
    if (rn)
      GS_MPI_CHECK(MPI_Irecv(into, rn, dt, peer, XCHG_TAG, c->mpi, &req[0]), "exchange: MPI_Irecv");
    if (sn)
      GS_MPI_CHECK(MPI_Isend(s, sn, dt, peer, XCHG_TAG, c->mpi, &req[1]), "exchange: MPI_Isend");
    for (int k = 0; k < 2; k++)
      if (req[k] != MPI_REQUEST_NULL)
        GS_CHECK(gs_mpi_wait(&req[k], k ? "exchange: send" : "exchange: receive", NULL, NULL));
    if (b && rn) memcpy(r, into, (size_t)rn * es);
  }
  return GS_SUCCESS;
}

const gs_transport_t gs_mpi_transport = {
    .name = "mpi",
    .allreduce = mpi_allreduce,
    .broadcast = mpi_broadcast,
    .allgatherv = mpi_allgatherv,
    .reduce_scatter = mpi_reduce_scatter,
    .exchange = mpi_exchange,
    /* the host's own memory: inside one host, read where it lies (cma.c) */
    .allreduce_segments = gs_cma_allreduce,
    .route = mpi_route,
    .init = gs_mpi_init, /* state.c */
    .free = gs_mpi_free,
};
