/* The topology-aware allreduce (docs/DESIGN.md section 11; hosts.c says which
 * ranks share a host and when this path is wanted).
 *
 * A job spanning hosts has two networks: shared memory inside a host, and
 * the host's link, which every byte leaving the host crosses. A flat ring
 * over P ranks sends 2(P-1)/P of the message over each ring edge, and with
 * several ranks per host some edges leave it. The hierarchical allreduce
 * sends each byte across the hosts once per host-level step:
 *
 *   1. reduce-scatter inside the host: local rank l ends up with block l of
 *      the host's sum (shared memory only);
 *   2. allreduce of block l across the hosts, among the ranks with local
 *      rank l (one cross-host communicator per local rank, all running at
 *      once, each carrying 1/L of the message);
 *   3. allgather inside the host: every rank gets every block.
 *
 * Per host, 2(H-1)/H of the message crosses its link (a ring over hosts);
 * a flat ring over all ranks sends 2(P-1)/P of it over each edge that
 * leaves a host. Every element's value is computed by exactly one
 * cross-host group and copied to the rest, so all ranks hold the same bits;
 * MPI's algorithms are deterministic for a given communicator, so runs
 * repeat bit for bit. The transport's ops are used as they are
 * (float16/bfloat16: gradsync's float32-accumulating user ops); averaging
 * and scales stay with the fusion engine, outside the transport. Where the
 * host's ranks may read each other's memory (cma.c), steps 1 and 3 read
 * the peers' blocks where they lie instead of going through MPI. */
#include <stdlib.h>
#include <string.h>

#include "transport/mpi/gs_mpi_transport.h"

void gs_hier_free(gs_comm_t c) {
  gs_mpi_state_t *s = gs_mpi_state(c);
  gs_cma_group_reset(&s->hier_cma, MPI_COMM_NULL);
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    if (s->hier_node != MPI_COMM_NULL) MPI_Comm_free(&s->hier_node);
    if (s->hier_cross != MPI_COMM_NULL) MPI_Comm_free(&s->hier_cross);
  }
  s->hier_node = s->hier_cross = MPI_COMM_NULL;
  s->hier_group = 0;
}

/* Made again if g changes. */
gs_status_t gs_hier_comms(gs_comm_t c, int g) {
  gs_mpi_state_t *s = gs_mpi_state(c);
  int fake = gs_env_hierarchy_size() > 0, key = fake ? g : -g;
  if (s->hier_node != MPI_COMM_NULL && s->hier_group == key) return GS_SUCCESS;
  gs_hier_free(c);
  int e, local = 0;
  if (fake) e = MPI_Comm_split(c->mpi, c->rank / g, c->rank, &s->hier_node);
  else e = MPI_Comm_split_type(c->mpi, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &s->hier_node);
  if (e == MPI_SUCCESS) e = MPI_Comm_rank(s->hier_node, &local);
  if (e == MPI_SUCCESS) e = MPI_Comm_split(c->mpi, local, c->rank, &s->hier_cross);
  if (e != MPI_SUCCESS) {
    gs_hier_free(c);
    return gs_mpi_fail(e, "hierarchical allreduce: MPI_Comm_split");
  }
  MPI_Comm_set_errhandler(s->hier_node, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(s->hier_cross, MPI_ERRORS_RETURN);
  gs_cma_group_reset(&s->hier_cma, s->hier_node);
  s->hier_group = key;
  return GS_SUCCESS;
}

static const char *const phase_names[3] = {
    "allreduce (hierarchical): reduce-scatter inside the host",
    "allreduce (hierarchical): allreduce across hosts",
    "allreduce (hierarchical): allgather inside the host"};

/* One call: the message in segments of `seg` elements (the last may be
 * shorter), each split into one block per local rank. */
typedef struct hier_run {
  gs_comm_t c;
  const char *send; /* NULL: in place */
  char *recv;
  int64_t count, seg, nseg;
  MPI_Datatype dt;
  MPI_Op op;
  gs_dtype_t dtype; /* the same two, for the host's direct reads */
  gs_op_t reduce;
  MPI_Comm node, cross;
  size_t es;
  int nl, l, nh;
  int *counts[2], *displs[2]; /* [0]: a full segment's blocks, [1]: the last one's */
  int64_t *counts64[2], *displs64[2]; /* the same, for the host's direct reads */
  int direct; /* the host stages read the peers' memory (cma.c) where they can */
} hier_run_t;

static void blocks(int64_t n, int nl, int *counts, int *displs) {
  for (int i = 0, at = 0; i < nl; i++) { /* balanced, as reduce_scatter's rows */
    counts[i] = (int)(n / nl + (i < n % nl));
    displs[i] = at;
    at += counts[i];
  }
}

/* Phase 0 (reduce-scatter: this rank's block straight to its place) or 2
 * (allgather) of segment k by reading the host's peers, synchronously;
 * *taken = 0 when the reads are not wanted or refused (then MPI's turn). */
static gs_status_t host_direct(const hier_run_t *h, int ph, int64_t k, int *taken) {
  int last = k == h->nseg - 1;
  const int64_t *counts = h->counts64[last], *displs = h->displs64[last];
  int64_t at = k * h->seg;
  char *base = h->recv + (size_t)at * h->es, *mine = base + (size_t)displs[h->l] * h->es;
  const char *in = h->send ? h->send + (size_t)at * h->es : base;
  if (ph == 0)
    return gs_cma_host_reduce_scatter(h->c, in, mine, counts, h->dtype, h->reduce, taken);
  return gs_cma_host_allgatherv(h->c, base, counts, displs, h->dtype, taken);
}

/* Starts phase `ph` of segment k; *req stays MPI_REQUEST_NULL when the
 * phase has nothing to send (one rank per host, one host, an empty block)
 * or was done here by direct reads (*placed: phase 0 left the block where
 * it belongs). */
static gs_status_t start(const hier_run_t *h, int ph, int64_t k, MPI_Request *req, int *placed) {
  int last = k == h->nseg - 1;
  const int *counts = h->counts[last], *displs = h->displs[last];
  int64_t at = k * h->seg, n = last ? h->count - at : h->seg;
  char *base = h->recv + (size_t)at * h->es, *mine = base + (size_t)displs[h->l] * h->es;
  const char *in = h->send ? h->send + (size_t)at * h->es : NULL;
  int e = MPI_SUCCESS, taken = 0;
  *req = MPI_REQUEST_NULL;
  if (ph != 1 && h->nl > 1 && h->direct) {
    GS_CHECK(host_direct(h, ph, k, &taken));
    if (taken) {
      if (ph == 0) *placed = 1; /* an allgather taken leaves it as it was */
      return GS_SUCCESS;
    }
  }
  if (ph == 0 && h->nl > 1) /* in place, MPI leaves the block at `base` */
    e = MPI_Ireduce_scatter(in ? (const void *)in : MPI_IN_PLACE, in ? (void *)mine : base, counts,
                            h->dt, h->op, h->node, req);
  else if (ph == 0 && in) memcpy(base, in, (size_t)n * h->es);
  else if (ph == 1 && h->nh > 1 && counts[h->l] > 0)
    e = MPI_Iallreduce(MPI_IN_PLACE, mine, counts[h->l], h->dt, h->op, h->cross, req);
  else if (ph == 2 && h->nl > 1)
    e = MPI_Iallgatherv(MPI_IN_PLACE, 0, h->dt, base, counts, displs, h->dt, h->node, req);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, phase_names[ph]);
}

/* Segment k's reduce-scatter finished in place: its block goes where the
 * allreduce across hosts and the allgather expect it. */
static void settle(const hier_run_t *h, int64_t k) {
  int last = k == h->nseg - 1;
  char *base = h->recv + (size_t)(k * h->seg) * h->es;
  size_t off = (size_t)h->displs[last][h->l] * h->es;
  if (!h->send && h->nl > 1 && off)
    memmove(base + off, base, (size_t)h->counts[last][h->l] * h->es);
}

/* A pipeline over the segments: at step t, segment t is reduce-scattered
 * inside the host while segment t-1 crosses the hosts and segment t-2 is
 * gathered, so shared-memory work hides behind the network's. The
 * nonblocking calls start in the same order on every rank, as MPI asks;
 * with direct reads (synchronous) the crossing starts first, so the host
 * stages run while it is in flight. */
static gs_status_t pipeline(const hier_run_t *h) {
  static const int order[2][3] = {{0, 1, 2}, {1, 0, 2}};
  gs_status_t s = GS_SUCCESS;
  for (int64_t t = 0; t < h->nseg + 2 && s == GS_SUCCESS; t++) {
    MPI_Request req[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    int placed = 0;
    for (int i = 0; i < 3 && s == GS_SUCCESS; i++) {
      int ph = order[h->direct][i];
      if (t - ph >= 0 && t - ph < h->nseg) s = start(h, ph, t - ph, &req[ph], &placed);
    }
    /* After a failure (a timeout: a host is gone) the phases still in flight
     * are not waited for, each could take the whole timeout again; they are
     * left to MPI with the communicator marked unusable, as abandoned waits
     * are (its buffers are kept). */
    for (int ph = 0; ph < 3 && s == GS_SUCCESS; ph++)
      if (req[ph] != MPI_REQUEST_NULL) s = gs_mpi_wait(&req[ph], phase_names[ph], NULL, NULL);
    if (s == GS_SUCCESS && t < h->nseg && !placed) settle(h, t);
  }
  if (s != GS_SUCCESS && !h->c->fate.broken) h->c->fate.broken = s;
  return s;
}

gs_status_t gs_hier_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                              gs_dtype_t dtype, gs_op_t op) {
  int g = gs_host_group(c);
  if (g == 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "allreduce (hierarchical): the hosts hold "
                   "unequal numbers of ranks");
  hier_run_t h = {.c = c,
                  .send = send,
                  .recv = recv,
                  .count = count,
                  .es = gs_dtype_size(dtype),
                  .dtype = dtype,
                  .reduce = op};
  GS_CHECK(gs_mpi_datatype(dtype, &h.dt));
  GS_CHECK(gs_mpi_op(dtype, op, &h.op));
  GS_CHECK(gs_hier_comms(c, g));
  c->stats.hierarchical++;
  h.node = gs_mpi_state(c)->hier_node;
  h.cross = gs_mpi_state(c)->hier_cross;
  MPI_Comm_size(h.node, &h.nl);
  MPI_Comm_rank(h.node, &h.l);
  MPI_Comm_size(h.cross, &h.nh);
  /* segments small enough to pipeline and for int counts; at least one
   * element per local rank */
  h.seg = GS_HIER_SEGMENT_BYTES / (int64_t)h.es;
  if (h.seg < h.nl) h.seg = h.nl;
  h.nseg = count > 0 ? (count + h.seg - 1) / h.seg : 0;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG,
           "allreduce: %lld elements hierarchical over %d hosts of %d ranks, "
           "%lld segments",
           (long long)count, h.nh, h.nl, (long long)h.nseg);
  int small[4 * 16];
  int64_t small64[4 * 16];
  int *cd = h.nl <= 16 ? small : malloc(4 * (size_t)h.nl * sizeof *cd);
  int64_t *cd64 = h.nl <= 16 ? small64 : malloc(4 * (size_t)h.nl * sizeof *cd64);
  gs_status_t s = GS_SUCCESS;
  if (!cd || !cd64) s = gs_fail(GS_ERR_NO_MEMORY, "allreduce (hierarchical): out of memory");
  for (int w = 0; w < 2 && s == GS_SUCCESS; w++) {
    h.counts[w] = cd + 2 * w * h.nl;
    h.displs[w] = cd + (2 * w + 1) * h.nl;
    blocks(w ? count - (h.nseg - 1) * h.seg : h.seg, h.nl, h.counts[w], h.displs[w]);
    h.counts64[w] = cd64 + 2 * w * h.nl;
    h.displs64[w] = cd64 + (2 * w + 1) * h.nl;
    for (int q = 0; q < h.nl; q++) {
      h.counts64[w][q] = h.counts[w][q];
      h.displs64[w][q] = h.displs[w][q];
    }
  }
  h.direct = gs_cma_host_wanted(c, h.seg * (int64_t)h.es);
  if (s == GS_SUCCESS && h.nseg > 0) s = pipeline(&h);
  if (cd != small) free(cd);
  if (cd64 != small64) free(cd64);
  return s;
}
