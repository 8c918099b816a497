/* The wire-format allreduce across hosts (gs_allreduce_wire on a job that
 * spans hosts): float32 sums inside each host (memory is cheap there), only
 * the cross-host stage in the wire format (wire.c's crossing), over blocks
 * of whole float8 blocks so the encoded blocks line up with the flat
 * algorithm's. lost: on this rank's host block only, what the cross-host
 * stage lost of it (the host's partial sum's rounding and the output's).
 *
 * The link is the bottleneck this path exists for, so the pipeline keeps it
 * busy: at step t
 *   1. segment t is prepared (the caller's packing) and reduce-scattered
 *      inside the host;
 *   2. segment t-3's allgather across the hosts is decoded and its
 *      allgather inside the host done (then it is finished: unpacked);
 *   3. segment t-2's exchange is reduced and its allgather started;
 *   4. segment t-1's block is encoded and its exchange started;
 * so two segments' transfers cross the link while the CPU packs, reduces,
 * encodes and decodes. Where the host's ranks read each other's memory
 * (cma.c) the host stages are synchronous reads; otherwise nonblocking MPI
 * calls, waited for a step later. Every rank starts the same MPI calls in
 * the same order on each communicator, as MPI asks. */
#include <stdlib.h>
#include <string.h>

#include "transport/mpi/gs_mpi_transport.h"

static const char *const host_names[2] = {
    "allreduce (hierarchical, wire): reduce-scatter inside the host",
    "allreduce (hierarchical, wire): allgather inside the host"};

typedef struct hier_wire {
  gs_comm_t c;
  float *x, *lost;
  int64_t count, seg, nseg;
  int nl, l, direct;
  const gs_wire_hooks_t *hooks;
  gs_wire_run_t run;
  /* [0]: a full segment's blocks, [1]: the last one's; counts then
   * displacements, as int (MPI) and int64 (the direct reads) */
  int *cd[2];
  int64_t *cd64[2];
  MPI_Request rs[2], ag[2]; /* segment k's host stages through MPI: [k % 2] */
  /* where the caller's message lies (hooks->out), for the host stages'
   * direct reads: its segments' first elements, and scratch for a
   * segment's share of them */
  int64_t *offs;
  gs_seg_t *part;
  int in_place[8]; /* segment k's host stages read and wrote the message itself: [k % 8] */
} hier_wire_t;

/* Whole float8 blocks of an n-element segment per local rank, balanced. */
static void wire_blocks(int64_t n, int nl, int *cd, int64_t *cd64) {
  int64_t nb = (n + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK;
  for (int q = 0, d = 0; q < nl; q++) {
    int64_t end = ((int64_t)(q + 1) * nb / nl) * GS_WIRE_BLOCK;
    cd[nl + q] = d;
    cd[q] = (int)((end < n ? end : n) - d);
    d += cd[q];
    cd64[q] = cd[q];
    cd64[nl + q] = cd[nl + q];
  }
}

static int64_t seg_first(const hier_wire_t *h, int64_t k) { return k * h->seg; }
static int64_t seg_count(const hier_wire_t *h, int64_t k) {
  return k == h->nseg - 1 ? h->count - k * h->seg : h->seg;
}

/* The caller's segments (which: 0 its input, 1 its output) over message
 * elements [first, first + n), into h->part; their number. */
static int64_t message_part(hier_wire_t *h, int which, int64_t first, int64_t n) {
  const gs_seg_t *all = which || !h->hooks->in ? h->hooks->out : h->hooks->in;
  int64_t lo = 0, hi = h->hooks->nseg - 1, m = 0;
  while (lo < hi) { /* the last segment starting at or before `first` */
    int64_t mid = (lo + hi + 1) / 2;
    if (h->offs[mid] <= first) lo = mid;
    else hi = mid - 1;
  }
  for (int64_t s = lo; s < h->hooks->nseg && h->offs[s] < first + n; s++) {
    int64_t a = h->offs[s] > first ? h->offs[s] : first;
    int64_t b = h->offs[s + 1] < first + n ? h->offs[s + 1] : first + n;
    if (a < b) h->part[m++] = (gs_seg_t){(float *)all[s].at + (a - h->offs[s]), b - a};
  }
  return m;
}

/* Segment k's reduce-scatter inside the host: read directly from the
 * caller's memory (nothing packed), or from the prepared segment (this
 * rank's block lands where it belongs), or started through MPI (in place:
 * MPI leaves the block at the segment's start; settle() moves it). */
static gs_status_t host_reduce_scatter(hier_wire_t *h, int64_t k) {
  int last = k == h->nseg - 1;
  float *base = h->x + seg_first(h, k);
  h->in_place[k % 8] = 0;
  if (h->direct && h->offs) {
    int taken = 0;
    int64_t m = message_part(h, 0, seg_first(h, k), seg_count(h, k));
    GS_CHECK(gs_cma_host_reduce_scatter_segs(h->c, h->part, m, base + h->cd[last][h->nl + h->l],
                                             h->cd64[last], GS_FLOAT32, GS_OP_SUM, &taken));
    if (taken) {
      h->in_place[k % 8] = 1;
      return GS_SUCCESS;
    }
  }
  GS_CHECK(gs_wire_hook(h->hooks, 0, seg_first(h, k), seg_count(h, k)));
  if (h->nl == 1) return GS_SUCCESS;
  if (h->direct) {
    int taken = 0;
    GS_CHECK(gs_cma_host_reduce_scatter(h->c, base, base + h->cd[last][h->nl + h->l], h->cd64[last],
                                        GS_FLOAT32, GS_OP_SUM, &taken));
    if (taken) return GS_SUCCESS;
    h->direct = 0; /* refused (the same on every rank): MPI from here on */
  }
  GS_CHECK(gs_runtime_watch(host_names[0])); /* a peer known gone is not posted to */
  int e = MPI_Ireduce_scatter(MPI_IN_PLACE, base, h->cd[last], MPI_FLOAT, MPI_SUM,
                              gs_mpi_state(h->c)->hier_node, &h->rs[k % 2]);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, host_names[0]);
}

/* Segment k's block, once reduced inside the host, where it belongs. */
static gs_status_t settle(hier_wire_t *h, int64_t k, float **mine, int64_t *n) {
  int last = k == h->nseg - 1;
  const int *cd = h->cd[last];
  float *base = h->x + seg_first(h, k);
  *mine = base + cd[h->nl + h->l];
  *n = cd[h->l];
  if (h->rs[k % 2] == MPI_REQUEST_NULL) return GS_SUCCESS; /* read directly, or nothing to do */
  GS_CHECK(gs_mpi_wait(&h->rs[k % 2], host_names[0], NULL, NULL));
  if (cd[h->nl + h->l]) memmove(*mine, base, (size_t)*n * sizeof(float));
  return GS_SUCCESS;
}

/* Segment k's allgather inside the host: read directly (then finished at
 * once) or started through MPI (finished a step later). */
static gs_status_t host_allgather(hier_wire_t *h, int64_t k) {
  int last = k == h->nseg - 1;
  float *base = h->x + seg_first(h, k);
  if (h->in_place[k % 8]) { /* every block straight into the caller's output */
    int taken = 0;
    int64_t m = message_part(h, 1, seg_first(h, k), seg_count(h, k));
    GS_CHECK(gs_cma_host_allgather_segs(h->c, base + h->cd[last][h->nl + h->l], h->part, m,
                                        h->cd64[last], GS_FLOAT32, &taken));
    if (taken) return GS_SUCCESS;
    /* not taken here after the reduce-scatter was (it cannot be: the same
     * size, a usable group): MPI's allgather, then the caller's finish */
    h->in_place[k % 8] = 0;
    h->direct = 0;
  }
  if (h->nl > 1 && h->direct) {
    int taken = 0;
    GS_CHECK(gs_cma_host_allgatherv(h->c, base, h->cd64[last], h->cd64[last] + h->nl, GS_FLOAT32,
                                    &taken));
    if (!taken) h->direct = 0;
  }
  if (h->nl > 1 && !h->direct) {
    GS_CHECK(gs_runtime_watch(host_names[1])); /* a peer known gone is not posted to */
    int e = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, base, h->cd[last], h->cd[last] + h->nl,
                            MPI_FLOAT, gs_mpi_state(h->c)->hier_node, &h->ag[k % 2]);
    return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, host_names[1]);
  }
  return gs_wire_hook(h->hooks, 1, seg_first(h, k), seg_count(h, k));
}

/* Segment k's allgather through MPI done: the segment is final. */
static gs_status_t host_finish(hier_wire_t *h, int64_t k) {
  if (h->ag[k % 2] == MPI_REQUEST_NULL) return GS_SUCCESS; /* finished already */
  GS_CHECK(gs_mpi_wait(&h->ag[k % 2], host_names[1], NULL, NULL));
  return gs_wire_hook(h->hooks, 1, seg_first(h, k), seg_count(h, k));
}

static gs_status_t step(hier_wire_t *h, int64_t t) {
  if (t < h->nseg) GS_CHECK(host_reduce_scatter(h, t));
  if (t >= 3 && t - 3 < h->nseg) {
    GS_CHECK(gs_wire_end(&h->run, t - 3));
    GS_CHECK(host_allgather(h, t - 3));
  }
  if (t >= 2 && t - 2 < h->nseg) GS_CHECK(gs_wire_middle(&h->run, t - 2));
  if (t >= 1 && t - 1 < h->nseg) {
    float *mine;
    int64_t n;
    GS_CHECK(settle(h, t - 1, &mine, &n));
    int64_t at = (mine - h->x);
    GS_CHECK(gs_wire_begin(&h->run, t - 1, mine, n, h->lost ? h->lost + at : NULL));
  }
  if (t >= 4 && t - 4 < h->nseg) GS_CHECK(host_finish(h, t - 4));
  return GS_SUCCESS;
}

gs_status_t gs_hier_wire_allreduce(gs_comm_t c, float *x, int64_t count, gs_wire_t wire,
                                   double post, float *lost, const gs_wire_hooks_t *hooks) {
  int g = gs_host_group(c);
  if (g == 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "allreduce (hierarchical): the hosts hold unequal numbers of ranks");
  GS_CHECK(gs_hier_comms(c, g));
  c->stats.hierarchical++;
  hier_wire_t h = {.c = c,
                   .x = x,
                   .lost = lost,
                   .count = count,
                   .hooks = hooks,
                   .rs = {MPI_REQUEST_NULL, MPI_REQUEST_NULL},
                   .ag = {MPI_REQUEST_NULL, MPI_REQUEST_NULL}};
  MPI_Comm_size(gs_mpi_state(c)->hier_node, &h.nl);
  MPI_Comm_rank(gs_mpi_state(c)->hier_node, &h.l);
  h.seg = (GS_HIER_SEGMENT_BYTES / 4) / GS_WIRE_BLOCK * GS_WIRE_BLOCK;
  h.nseg = count > 0 ? (count + h.seg - 1) / h.seg : 0;
  if (h.nseg == 0) return GS_SUCCESS;
  int *cd = malloc(4 * (size_t)h.nl * sizeof *cd);
  int64_t *cd64 = malloc(4 * (size_t)h.nl * sizeof *cd64);
  gs_status_t s = GS_SUCCESS;
  if (!cd || !cd64) s = gs_fail(GS_ERR_NO_MEMORY, "allreduce (hierarchical, wire): out of memory");
  h.direct = h.nl > 1 && gs_cma_host_wanted(c, h.seg * (int64_t)sizeof(float));
  if (s == GS_SUCCESS && h.direct && hooks && hooks->out && hooks->nseg > 0) {
    h.offs = malloc(((size_t)hooks->nseg + 1) * sizeof *h.offs);
    h.part = malloc((size_t)hooks->nseg * sizeof *h.part);
    if (!h.offs || !h.part)
      s = gs_fail(GS_ERR_NO_MEMORY, "allreduce (hierarchical, wire): out of memory");
    if (s == GS_SUCCESS) h.offs[0] = 0;
    for (int64_t i = 0; s == GS_SUCCESS && i < hooks->nseg; i++)
      h.offs[i + 1] = h.offs[i] + hooks->out[i].count;
  }
  if (s == GS_SUCCESS) {
    h.cd[0] = cd;
    h.cd[1] = cd + 2 * h.nl;
    h.cd64[0] = cd64;
    h.cd64[1] = cd64 + 2 * h.nl;
    wire_blocks(h.seg, h.nl, h.cd[0], h.cd64[0]);
    wire_blocks(count - (h.nseg - 1) * h.seg, h.nl, h.cd[1], h.cd64[1]);
    /* a rank's block of a segment: at most its share of whole blocks, plus one */
    s = gs_wire_run_open(&h.run, c, gs_mpi_state(c)->hier_cross, wire, post,
                         (h.seg / GS_WIRE_BLOCK / h.nl + 1) * GS_WIRE_BLOCK);
  }
  /* after a failure the transfers in flight are left to MPI with the
   * communicator marked unusable, as the float32 pipeline's */
  for (int64_t t = 0; s == GS_SUCCESS && t < h.nseg + 4; t++) s = step(&h, t);
  free(cd);
  free(cd64);
  free(h.offs);
  free(h.part);
  if (s != GS_SUCCESS && !c->fate.broken) c->fate.broken = s;
  return s;
}
