/* Hosts, and the topology-aware allreduce (DESIGN section 11).
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
 * and scales stay with the fusion engine, outside the transport.
 *
 * Hosts are MPI_Comm_split_type(SHARED) groups, agreed once when the
 * communicator is made; GRADSYNC_HIERARCHY_SIZE=g replaces them with blocks
 * of g consecutive ranks (tests on one machine, hosts MPI cannot see). */
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

/* Pieces of at most this many elements: every count and displacement of one
 * piece's calls fits MPI's int. */
#define HIER_PIECE ((int64_t)1 << 30)
/* Below this, a message is latency bound: the flat path's recursive doubling
 * (one step per rank doubling) is as cheap as three hierarchical phases,
 * and sends the same single cross-host step. Measured on the simulated
 * cluster (docs/PERFORMANCE.md, "Across hosts"). */
#define HIER_MIN_BYTES ((int64_t)65536)

gs_status_t gs_topology_init(gs_comm_t c) {
  /* max of (L, -L, not-consecutive) over the ranks: min and max local size,
   * and whether every host's ranks are a block of consecutive ranks
   * (local rank == rank mod L on every rank implies it when sizes agree). */
  int mine[3] = {c->local_size, -c->local_size, c->local_rank != c->rank % c->local_size};
  int all[3];
  int e = MPI_Allreduce(mine, all, 3, MPI_INT, MPI_MAX, c->mpi);
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "gs_comm_create: agreeing on the hosts");
  c->host_max = all[0];
  c->host_min = -all[1];
  c->hosts_consecutive = all[2] == 0;
  c->hier_mode = gs_env_hierarchical();
  c->hier_node = c->hier_cross = MPI_COMM_NULL;
  c->hier_group = 0;
  return GS_SUCCESS;
}

int gs_host_group(gs_comm_t c) {
  int g = gs_env_hierarchy_size();
  if (g > 0) return c->size % g == 0 ? g : 0;
  return c->host_min == c->host_max ? c->host_max : 0;
}

int gs_hier_wanted(gs_comm_t c, int64_t bytes) {
  if (c->hier_mode == 0 || c->size == 1) return 0;
  int g = gs_host_group(c);
  if (g == 0) {
    static int warned;
    if (c->hier_mode == 1 && !__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
      gs_log(GS_LOG_WARNING, "GRADSYNC_HIERARCHICAL=1: the hosts hold unequal numbers of "
             "ranks (%d to %d%s), so allreduce stays flat", c->host_min, c->host_max,
             gs_env_hierarchy_size() > 0 ? ", or GRADSYNC_HIERARCHY_SIZE does not divide the "
             "ranks" : "");
    return 0;
  }
  if (c->hier_mode == 1) return 1;
  return g > 1 && c->size / g > 1 && bytes >= HIER_MIN_BYTES;
}

void gs_hier_free(gs_comm_t c) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    if (c->hier_node != MPI_COMM_NULL) MPI_Comm_free(&c->hier_node);
    if (c->hier_cross != MPI_COMM_NULL) MPI_Comm_free(&c->hier_cross);
  }
  c->hier_node = c->hier_cross = MPI_COMM_NULL;
  c->hier_group = 0;
}

/* The host and cross-host communicators for groups of g ranks (made on the
 * first hierarchical call, collectively, and again if g changes). */
static gs_status_t hier_comms(gs_comm_t c, int g) {
  int fake = gs_env_hierarchy_size() > 0, key = fake ? g : -g;
  if (c->hier_node != MPI_COMM_NULL && c->hier_group == key) return GS_SUCCESS;
  gs_hier_free(c);
  int e, local = 0;
  if (fake)
    e = MPI_Comm_split(c->mpi, c->rank / g, c->rank, &c->hier_node);
  else
    e = MPI_Comm_split_type(c->mpi, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &c->hier_node);
  if (e == MPI_SUCCESS) e = MPI_Comm_rank(c->hier_node, &local);
  if (e == MPI_SUCCESS) e = MPI_Comm_split(c->mpi, local, c->rank, &c->hier_cross);
  if (e != MPI_SUCCESS) {
    gs_hier_free(c);
    return gs_mpi_fail(e, "hierarchical allreduce: MPI_Comm_split");
  }
  MPI_Comm_set_errhandler(c->hier_node, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(c->hier_cross, MPI_ERRORS_RETURN);
  c->hier_group = key;
  return GS_SUCCESS;
}

static gs_status_t start_wait(int e, MPI_Request *req, const char *what) {
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, what);
  return gs_mpi_wait(req, what, NULL, NULL);
}

/* One piece (n <= HIER_PIECE elements): the three phases. counts/displs
 * have room for L ints each. */
static gs_status_t hier_piece(gs_comm_t c, const char *send, char *recv, int64_t n,
                              MPI_Datatype dt, MPI_Op op, size_t es, int *counts,
                              int *displs) {
  int nl = 0, l = 0, nh = 0;
  MPI_Comm_size(c->hier_node, &nl);
  MPI_Comm_rank(c->hier_node, &l);
  MPI_Comm_size(c->hier_cross, &nh);
  for (int i = 0, at = 0; i < nl; i++) { /* balanced blocks, as reduce_scatter's rows */
    counts[i] = (int)(n / nl + (i < n % nl));
    displs[i] = at;
    at += counts[i];
  }
  char *mine = recv + (size_t)displs[l] * es;
  MPI_Request req;
  if (nl > 1) {
    /* in place, MPI leaves this rank's block at the start of recv */
    GS_CHECK(start_wait(MPI_Ireduce_scatter(send ? (const void *)send : MPI_IN_PLACE,
                                            send ? (void *)mine : (void *)recv, counts, dt, op,
                                            c->hier_node, &req),
                        &req, "allreduce (hierarchical): reduce-scatter inside the host"));
    if (!send && mine != recv) memmove(mine, recv, (size_t)counts[l] * es);
  } else if (send) {
    memcpy(recv, send, (size_t)n * es);
  }
  if (nh > 1 && counts[l] > 0)
    GS_CHECK(start_wait(MPI_Iallreduce(MPI_IN_PLACE, mine, counts[l], dt, op, c->hier_cross,
                                       &req),
                        &req, "allreduce (hierarchical): allreduce across hosts"));
  if (nl > 1)
    GS_CHECK(start_wait(MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, recv, counts, displs, dt,
                                        c->hier_node, &req),
                        &req, "allreduce (hierarchical): allgather inside the host"));
  return GS_SUCCESS;
}

gs_status_t gs_hier_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                              gs_dtype_t dtype, gs_op_t op) {
  int g = gs_host_group(c);
  if (g == 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "allreduce (hierarchical): the hosts hold "
                   "unequal numbers of ranks");
  MPI_Datatype dt = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  GS_CHECK(gs_mpi_op(dtype, op, &mop));
  GS_CHECK(hier_comms(c, g));
  c->stats.hierarchical++;
  if (gs_log_level() >= GS_LOG_DEBUG)
    gs_log(GS_LOG_DEBUG, "allreduce: %lld elements hierarchical over %d hosts of %d ranks",
           (long long)count, c->size / g, g);
  int small[2 * 64];
  int *cd = g <= 64 ? small : malloc(2 * (size_t)g * sizeof *cd);
  if (!cd) return gs_fail(GS_ERR_NO_MEMORY, "allreduce (hierarchical): out of memory");
  size_t es = gs_dtype_size(dtype);
  gs_status_t s = GS_SUCCESS;
  for (int64_t off = 0; off < count && s == GS_SUCCESS; off += HIER_PIECE) {
    int64_t n = count - off < HIER_PIECE ? count - off : HIER_PIECE;
    s = hier_piece(c, send ? (const char *)send + (size_t)off * es : NULL,
                   (char *)recv + (size_t)off * es, n, dt, mop, es, cd, cd + g);
  }
  if (cd != small) free(cd);
  return s;
}
