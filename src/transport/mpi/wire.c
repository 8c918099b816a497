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
 * segment's start; segments are whole blocks too, so block boundaries, and
 * with them the float8 scales of the inputs, depend neither on the rank
 * count nor on the segment size.
 *
 * A segment's crossing is three steps (begin: encode, start the exchange;
 * middle: reduce, start the allgather; end: decode), each returning with
 * its transfer in flight, so a pipeline keeps the link busy with one
 * segment while the CPU encodes, reduces or decodes others (the link, not
 * the CPU, is what the wire format saves; idle link time is lost). */
#include <stdlib.h>
#include <string.h>

#include "transport/mpi/gs_mpi_transport.h"
#include "kernels/wire_format.h"

/* The flat path's segment: 4 MiB of float32, as the hierarchical path's. */
#define FLAT_SEGMENT ((int64_t)GS_WIRE_BLOCK << 15) /* 1 Mi elements */

/* Scratch for one slot: 4p ints, then the packed shards, P received
 * copies of this rank's shard, and the owner's float32 sums. */
static size_t slot_bytes(gs_wire_t wire, int p, int64_t seg, size_t parts[4]) {
  int64_t mine = gs_wire_bytes(wire, (seg / GS_WIRE_BLOCK / p + 1) * GS_WIRE_BLOCK);
  parts[0] = (4 * (size_t)p * sizeof(int) + 63) / 64 * 64;
  parts[1] = ((size_t)gs_wire_bytes(wire, seg) + (size_t)p + 63) / 64 * 64;
  parts[2] = ((size_t)p * (size_t)mine + 63) / 64 * 64;
  parts[3] = (size_t)(seg / p + GS_WIRE_BLOCK) * sizeof(float);
  return parts[0] + parts[1] + parts[2] + parts[3];
}

/* The communicator keeps the scratch (MPI sees the same memory every
 * call: owned.c says why; and no page is faulted in again per call). */
static gs_status_t scratch(gs_comm_t c, size_t bytes, char **buf) {
  gs_mpi_state_t *s = gs_mpi_state(c);
  GS_CHECK(
      gs_owned_grow(&s->wire_scratch, &s->wire_scratch_bytes, bytes, "allreduce (wire): scratch"));
  *buf = s->wire_scratch;
  return GS_SUCCESS;
}

gs_status_t gs_wire_run_open(gs_wire_run_t *w, gs_comm_t c, MPI_Comm mc, gs_wire_t wire,
                             double post, int64_t seg) {
  memset(w, 0, sizeof *w);
  w->c = c;
  w->mc = mc;
  w->wire = wire;
  w->post = (float)post;
  MPI_Comm_size(mc, &w->p);
  MPI_Comm_rank(mc, &w->r);
  size_t parts[4], one = slot_bytes(wire, w->p, seg, parts);
  char *buf = NULL;
  GS_CHECK(scratch(c, GS_WIRE_DEPTH * one, &buf));
  for (int i = 0; i < GS_WIRE_DEPTH; i++, buf += one) {
    gs_wire_slot_t *s = &w->slot[i];
    s->bytes = (int *)buf;
    s->displs = s->bytes + w->p;
    s->rbytes = s->bytes + 2 * w->p;
    s->rdispls = s->bytes + 3 * w->p;
    s->packed = buf + parts[0];
    s->recv = s->packed + parts[1];
    s->acc = (float *)(s->recv + parts[2]);
    s->req = MPI_REQUEST_NULL;
  }
  return GS_SUCCESS;
}

/* Step 1 of segment k: encode every shard, start the exchange. */
gs_status_t gs_wire_begin(gs_wire_run_t *w, int64_t k, float *x, int64_t n, float *lost) {
  gs_wire_slot_t *s = &w->slot[k % GS_WIRE_DEPTH];
  s->x = x;
  s->lost = lost;
  s->n = n;
  int64_t first, count, at = 0;
  for (int q = 0; q < w->p; q++) {
    gs_wire_shard(n, w->p, q, &first, &count);
    s->bytes[q] = (int)gs_wire_bytes(w->wire, count);
    s->displs[q] = (int)at;
    gs_wire_encode(w->wire, x + first, count, s->packed + at, lost ? lost + first : NULL);
    at += s->bytes[q];
  }
  for (int q = 0; q < w->p; q++) {
    s->rbytes[q] = s->bytes[w->r];
    s->rdispls[q] = q * s->bytes[w->r];
  }
  /* the counters say what this rank sends: its peers' shards here, its own
   * to each peer in the allgather */
  gs_count_message(w->c, at - s->bytes[w->r], GS_UINT8);
  /* a peer known gone is not posted to: MPICH over UCX can crash in the post */
  GS_CHECK(gs_runtime_watch("allreduce (wire): MPI_Ialltoallv"));
  int e = MPI_Ialltoallv(s->packed, s->bytes, s->displs, MPI_BYTE, s->recv, s->rbytes, s->rdispls,
                         MPI_BYTE, w->mc, &s->req);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, "allreduce (wire): MPI_Ialltoallv");
}

/* Step 2: the owner's float32 sum in rank order, scaled, rounded once into
 * its place among the packed shards; start the allgather. */
gs_status_t gs_wire_middle(gs_wire_run_t *w, int64_t k) {
  gs_wire_slot_t *s = &w->slot[k % GS_WIRE_DEPTH];
  GS_CHECK(gs_mpi_wait(&s->req, "allreduce (wire): MPI_Ialltoallv", NULL, NULL));
  int64_t first, count;
  gs_wire_shard(s->n, w->p, w->r, &first, &count);
  if (count > 0) {
    float *out_lost = NULL;
    if (s->lost && w->post != 0.0f) {
      out_lost = s->acc; /* the output's rounding, in input units */
      memset(out_lost, 0, (size_t)count * sizeof(float));
    }
    gs_wire_reduce(w->wire, s->recv, (size_t)s->bytes[w->r], w->p, count, w->post,
                   s->packed + s->displs[w->r], out_lost);
    for (int64_t i = 0; out_lost && i < count; i++) s->lost[first + i] += out_lost[i] / w->post;
  }
  gs_count_message(w->c, (int64_t)s->bytes[w->r] * (w->p - 1), GS_UINT8);
  GS_CHECK(gs_runtime_watch("allreduce (wire): MPI_Iallgatherv")); /* as above */
  int e = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, s->packed, s->bytes, s->displs, MPI_BYTE,
                          w->mc, &s->req);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, "allreduce (wire): MPI_Iallgatherv");
}

/* Step 3: every shard decoded into the segment. */
gs_status_t gs_wire_end(gs_wire_run_t *w, int64_t k) {
  gs_wire_slot_t *s = &w->slot[k % GS_WIRE_DEPTH];
  GS_CHECK(gs_mpi_wait(&s->req, "allreduce (wire): MPI_Iallgatherv", NULL, NULL));
  int64_t first, count;
  for (int q = 0; q < w->p; q++) {
    gs_wire_shard(s->n, w->p, q, &first, &count);
    gs_wire_decode(w->wire, s->packed + s->displs[q], count, s->x + first);
  }
  return GS_SUCCESS;
}

gs_status_t gs_wire_hook(const gs_wire_hooks_t *hooks, int finish, int64_t first, int64_t n) {
  if (!hooks || n <= 0) return GS_SUCCESS;
  gs_status_t (*fn)(void *, int64_t, int64_t) = finish ? hooks->finish : hooks->prepare;
  return fn ? fn(hooks->ctx, first, n) : GS_SUCCESS;
}

/* The pipeline over segments: at step t segment t is prepared and begun,
 * t-1's exchange is reduced and t-2's allgather decoded and finished, so
 * two segments' transfers are in flight while the CPU works on a third.
 * Every rank starts the same calls in the same order, as MPI asks. After a
 * failure the transfers in flight are left to MPI with the communicator
 * marked unusable (their scratch is the communicator's and is kept). */
gs_status_t gs_wire_allreduce(gs_comm_t c, MPI_Comm mc, float *x, int64_t count, gs_wire_t wire,
                              double post, float *lost, const gs_wire_hooks_t *hooks) {
  int64_t seg = count < FLAT_SEGMENT ? count : FLAT_SEGMENT;
  int64_t nseg = count > 0 ? (count + seg - 1) / seg : 0;
  gs_wire_run_t w;
  GS_CHECK(gs_wire_run_open(&w, c, mc, wire, post, seg));
  gs_status_t s = GS_SUCCESS;
  for (int64_t t = 0; t < nseg + 2 && s == GS_SUCCESS; t++) {
    if (t < nseg) {
      int64_t at = t * seg, n = count - at < seg ? count - at : seg;
      s = gs_wire_hook(hooks, 0, at, n);
      if (s == GS_SUCCESS) s = gs_wire_begin(&w, t, x + at, n, lost ? lost + at : NULL);
    }
    if (s == GS_SUCCESS && t >= 1 && t - 1 < nseg) s = gs_wire_middle(&w, t - 1);
    if (s == GS_SUCCESS && t >= 2) {
      int64_t at = (t - 2) * seg, n = count - at < seg ? count - at : seg;
      s = gs_wire_end(&w, t - 2);
      if (s == GS_SUCCESS) s = gs_wire_hook(hooks, 1, at, n);
    }
  }
  if (s != GS_SUCCESS && !c->fate.broken) c->fate.broken = s;
  return s;
}
