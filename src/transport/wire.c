/* The allreduce in a low-precision wire format (gs_allreduce_wire).
 *
 * A cast-then-reduce allreduce rounds every partial sum to the wire format:
 * a ring rounds at each of its P-1 hops and the error grows with P. Here
 * the reduce-scatter is a direct exchange instead: each rank encodes every
 * peer's shard once and sends it there (one alltoallv), the owner decodes
 * the P contributions, sums them in float32 in rank order, applies the
 * postscale and rounds once, and an allgather hands every rank the rounded
 * shard. Each input is rounded once and the output once, whatever P is;
 * every rank decodes the same bytes, so every rank holds the same bits.
 *
 * Shards are whole float8 blocks (GS_WIRE_BLOCK elements) counted from the
 * message's start, so block boundaries, and with them the float8 scales of
 * the inputs, do not depend on the rank count. Messages go in segments of
 * SEGMENT elements so every MPI count fits an int and scratch stays bounded. */
#include <stdlib.h>
#include <string.h>

#include "transport/gs_transport.h"
#include "kernels/wire_format.h"

#define SEGMENT ((int64_t)GS_WIRE_BLOCK << 18) /* 8 Mi elements */

typedef struct wire_run {
  gs_comm_t c;
  MPI_Comm mc;
  int p, r;
  gs_wire_t wire;
  float post;
  int *bytes, *displs; /* per rank: wire bytes of its shard and where they lie */
  int *rbytes, *rdispls;
  char *packed, *recv; /* every shard encoded (send, then gathered); P copies of mine */
  float *acc;
} wire_run_t;

/* Step 1: encode every shard, exchange. */
static gs_status_t scatter(wire_run_t *w, const float *x, int64_t n, float *lost) {
  int64_t first, count, at = 0;
  for (int q = 0; q < w->p; q++) {
    gs_wire_shard(n, w->p, q, &first, &count);
    w->bytes[q] = (int)gs_wire_bytes(w->wire, count);
    w->displs[q] = (int)at;
    gs_wire_encode(w->wire, x + first, count, w->packed + at, lost ? lost + first : NULL);
    at += w->bytes[q];
  }
  for (int q = 0; q < w->p; q++) {
    w->rbytes[q] = w->bytes[w->r];
    w->rdispls[q] = q * w->bytes[w->r];
  }
  /* the counters say what this rank sends: its peers' shards here, its own
   * to each peer in the allgather */
  gs_count_message(w->c, at - w->bytes[w->r], GS_UINT8);
  MPI_Request req;
  return gs_mpi_finish(MPI_Ialltoallv(w->packed, w->bytes, w->displs, MPI_BYTE, w->recv, w->rbytes,
                                      w->rdispls, MPI_BYTE, w->mc, &req),
                       &req, "allreduce (wire): MPI_Ialltoallv");
}

/* Step 2: the owner's float32 sum in rank order, scaled, rounded once into
 * its place among the packed shards; then the allgather and decoding. */
static gs_status_t reduce_gather(wire_run_t *w, float *x, int64_t n, float *lost) {
  int64_t first, count;
  gs_wire_shard(n, w->p, w->r, &first, &count);
  if (count > 0) {
    float *out_lost = NULL;
    if (lost && w->post != 0.0f) {
      out_lost = w->acc; /* the output's rounding, in input units */
      memset(out_lost, 0, (size_t)count * sizeof(float));
    }
    gs_wire_reduce(w->wire, w->recv, (size_t)w->bytes[w->r], w->p, count, w->post,
                   w->packed + w->displs[w->r], out_lost);
    for (int64_t i = 0; out_lost && i < count; i++) lost[first + i] += out_lost[i] / w->post;
  }
  gs_count_message(w->c, (int64_t)w->bytes[w->r] * (w->p - 1), GS_UINT8);
  MPI_Request req;
  GS_CHECK(gs_mpi_finish(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, w->packed, w->bytes, w->displs,
                                         MPI_BYTE, w->mc, &req),
                         &req, "allreduce (wire): MPI_Iallgatherv"));
  for (int q = 0; q < w->p; q++) {
    gs_wire_shard(n, w->p, q, &first, &count);
    gs_wire_decode(w->wire, w->packed + w->displs[q], count, x + first);
  }
  return GS_SUCCESS;
}

/* Scratch for segments of up to `seg` elements. */
static gs_status_t wire_alloc(wire_run_t *w, int64_t seg) {
  int64_t mine = gs_wire_bytes(w->wire, (seg / GS_WIRE_BLOCK / w->p + 1) * GS_WIRE_BLOCK);
  w->bytes = malloc(4 * (size_t)w->p * sizeof(int));
  w->packed = malloc((size_t)gs_wire_bytes(w->wire, seg) + (size_t)w->p);
  w->recv = malloc((size_t)w->p * (size_t)mine);
  w->acc = malloc(2 * (size_t)(seg / w->p + GS_WIRE_BLOCK) * sizeof(float));
  if (!w->bytes || !w->packed || !w->recv || !w->acc)
    return gs_fail(GS_ERR_NO_MEMORY, "allreduce (wire): out of memory for %lld elements",
                   (long long)seg);
  w->displs = w->bytes + w->p;
  w->rbytes = w->bytes + 2 * w->p;
  w->rdispls = w->bytes + 3 * w->p;
  return GS_SUCCESS;
}

gs_status_t gs_wire_allreduce(gs_comm_t c, MPI_Comm mc, float *x, int64_t count, gs_wire_t wire,
                              double post, float *lost) {
  wire_run_t w = {.c = c, .mc = mc, .wire = wire, .post = (float)post};
  MPI_Comm_size(mc, &w.p);
  MPI_Comm_rank(mc, &w.r);
  int64_t seg = count < SEGMENT ? count : SEGMENT;
  gs_status_t s = wire_alloc(&w, seg);
  for (int64_t at = 0; s == GS_SUCCESS && at < count; at += seg) {
    int64_t n = count - at < seg ? count - at : seg;
    s = scatter(&w, x + at, n, lost ? lost + at : NULL);
    if (s == GS_SUCCESS) s = reduce_gather(&w, x + at, n, lost ? lost + at : NULL);
  }
  free(w.bytes);
  free(w.packed);
  free(w.recv);
  free(w.acc);
  return s;
}
