/* The MPI transport's working state (gs_mpi_state_t, c->host_state): made
 * by the table's init with every communicator, after the ranks agree on the
 * hosts, and freed by its free. Apart from hosts.c, which the paths ask on
 * every message and which calls none of them: freeing calls into
 * hierarchical.c and cma_group.c. */
#include <stdlib.h>

#include "transport/mpi/gs_mpi_transport.h"

/* The table's init: the ranks agree on the hosts (c->host_min, host_max,
 * hosts_consecutive, which other layers read) and the transport's state is
 * made (c->host_state, which none does). */
gs_status_t gs_mpi_init(gs_comm_t c) {
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
  gs_mpi_state_t *s = calloc(1, sizeof *s);
  if (!s) return gs_fail(GS_ERR_NO_MEMORY, "gs_comm_create: out of memory");
  s->hier_mode = gs_env_hierarchical();
  s->hier_node = s->hier_cross = MPI_COMM_NULL;
  s->cma_hugepages = gs_env_cma_hugepages();
  s->cma = (gs_cma_group_t){.mpi = MPI_COMM_NULL};      /* the communicator's, at first use */
  s->hier_cma = (gs_cma_group_t){.mpi = MPI_COMM_NULL}; /* made with hier_node */
  c->host_state = s;
  return GS_SUCCESS;
}

/* The table's free: every piece of the state, the host communicators while
 * MPI is up (gs_hier_free asks). */
gs_status_t gs_mpi_free(gs_comm_t c) {
  gs_mpi_state_t *s = gs_mpi_state(c);
  if (!s) return GS_SUCCESS;
  gs_hier_free(c);
  gs_cma_group_reset(&s->cma, MPI_COMM_NULL);
  free(s->bounce);
  free(s->wire_scratch);
  free(s);
  c->host_state = NULL;
  return GS_SUCCESS;
}
