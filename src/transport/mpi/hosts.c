/* Hosts: which ranks share one, agreed when a communicator is made, and
 * whether an allreduce takes the hierarchical path (hierarchical.c) over
 * them (docs/DESIGN.md section 11). Apart from hierarchical.c so the host-local
 * paths (cma.c) can ask without calling into the path that uses them.
 *
 * Hosts are MPI_Comm_split_type(SHARED) groups; GRADSYNC_HIERARCHY_SIZE=g
 * replaces them with blocks of g consecutive ranks (tests on one machine,
 * hosts MPI cannot see). */
#include "transport/mpi/gs_mpi_transport.h"

/* Auto mode's smallest hierarchical message: two segments, the least that
 * overlaps shared-memory phases with the network. Below it the three phases
 * run back to back, one more round than MPI's flat algorithms, which for
 * power-of-two ranks placed by host cross each link with as many bytes;
 * on the simulated cluster flat was ahead up to 4 MiB and even or behind
 * from 16 MiB (docs/PERFORMANCE.md, "Across hosts"). */
#define HIER_MIN_BYTES (2 * GS_HIER_SEGMENT_BYTES)

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
  c->hier_cma = (gs_cma_group_t){.mpi = MPI_COMM_NULL}; /* made with hier_node */
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
      gs_log(GS_LOG_WARNING,
             "GRADSYNC_HIERARCHICAL=1: the hosts hold unequal numbers of "
             "ranks (%d to %d%s), so allreduce stays flat",
             c->host_min, c->host_max,
             gs_env_hierarchy_size() > 0 ? ", or GRADSYNC_HIERARCHY_SIZE does not divide the "
                                           "ranks"
                                         : "");
    return 0;
  }
  if (c->hier_mode == 1) return 1;
  return g > 1 && c->size / g > 1 && bytes >= HIER_MIN_BYTES;
}
