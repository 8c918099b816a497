/* gradsync private, transport/mpi/: MPI's own exchange collectives on host
 * memory (mpi_xfer.c), which algorithms/xfer.c runs when every count fits
 * MPI's int; apart from gs_mpi_transport.h so that caller sees no more of
 * the MPI transport than these. */
#ifndef GRADSYNC_MPI_XFER_H
#define GRADSYNC_MPI_XFER_H

#include "transport/gs_transport.h"

/* One tensor's movement. Per-rank arrays have comm->size entries. */
typedef struct gs_xfer {
  gs_dtype_t dtype;
  int root;                         /* gatherv, scatterv */
  const void *send;
  void *recv;
  const int64_t *scounts, *sdispls; /* alltoallv; scatterv at the root */
  const int64_t *rcounts, *rdispls; /* alltoallv; gatherv at the root */
  int64_t scount, rcount;           /* gatherv's send, scatterv's receive */
  int native;                       /* MPI's own collective (all counts fit int) */
} gs_xfer_t;

/* MPI's own collectives (counts must fit int). */
gs_status_t gs_mpi_alltoallv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_gatherv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_scatterv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_reduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                          gs_dtype_t dtype, gs_op_t op, int root);

#endif
