/* Hosts: which ranks share one, agreed when a communicator is made
 * (state.c), and whether an allreduce takes the hierarchical path
 * (hierarchical.c) over them (docs/DESIGN.md section 11). Apart from hierarchical.c so the host-local
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

int gs_host_group(gs_comm_t c) {
  int g = gs_env_hierarchy_size();
  if (g > 0) return c->size % g == 0 ? g : 0;
  return c->host_min == c->host_max ? c->host_max : 0;
}

int gs_hier_wanted(gs_comm_t c, int64_t bytes) {
  int mode = gs_mpi_state(c)->hier_mode;
  if (mode == 0 || c->size == 1) return 0;
  int g = gs_host_group(c);
  if (g == 0) {
    static int warned;
    if (mode == 1 && !__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
      gs_log(GS_LOG_WARNING,
             "GRADSYNC_HIERARCHICAL=1: the hosts hold unequal numbers of "
             "ranks (%d to %d%s), so allreduce stays flat",
             c->host_min, c->host_max,
             gs_env_hierarchy_size() > 0 ? ", or GRADSYNC_HIERARCHY_SIZE does not divide the "
                                           "ranks"
                                         : "");
    return 0;
  }
  if (mode == 1) return 1;
  return g > 1 && c->size / g > 1 && bytes >= HIER_MIN_BYTES;
}
