/* gradsync private, mpi/ (a layer: docs/ARCHITECTURE.md): a communicator's state. Every layer
 * from here up reads its fields; comm/lifecycle.c owns its lifetime, and each field's
 * comment names the file that owns it. */
#ifndef GRADSYNC_COMM_STATE_H
#define GRADSYNC_COMM_STATE_H

#include <mpi.h>

#include "gs_comm.h"
#include "device/gs_cuda.h"

struct gs_comm {
  uint32_t magic;          /* GS_COMM_MAGIC while alive: catches stale handles */
  MPI_Comm mpi;            /* our duplicate: all collectives go here */
  MPI_Comm notice;         /* second duplicate: stall notices, point to point */
  int rank, size, local_rank, local_size;
  int64_t fusion_threshold;
  int64_t direct_bytes;    /* tensors of at least this many bytes go alone */
  int64_t pipeline_bytes;  /* host allreduce messages go in pieces this large (0: whole) */
  int check;
  double stall_seconds;
  uint64_t seq;            /* collectives begun so far (skeleton.c, lifecycle.c): names a
                            * call in notices, errors and the flight record */
  uint64_t p2p_seq;        /* sends and receives begun so far (p2p.c) */
  int32_t flight;          /* this communicator in the flight recorder's table (-1: none) */
  gs_comm_stats_t stats;
  MPI_Comm *adasum_levels; /* level k: blocks of 2^(k+1) ranks; cached */
  int adasum_nlevels;
  void *adasum_tmp;        /* received halves, grows on demand */
  size_t adasum_tmp_bytes;
  void *fusion;            /* persistent fusion buffer, grows on demand */
  size_t fusion_bytes;
  /* CUDA memory (engine/path.c): the path is chosen at the first such call */
  int dev_path;            /* GS_PATH_* */
  int dev_id;              /* the CUDA device this communicator serves */
  void *dev_stream;
  void *nccl;              /* ncclComm_t on GS_PATH_NCCL */
  void *dev_fusion;        /* device fusion buffer */
  size_t dev_fusion_bytes;
  void *dev_tmp;           /* device scratch: Adasum's received halves */
  size_t dev_tmp_bytes;
  void *dev_keys;          /* device scratch: NCCL min/max order keys */
  size_t dev_keys_bytes;
  void *pinned;            /* pinned host staging for GS_PATH_STAGED */
  size_t pinned_bytes;
  gs_fate_t fate;          /* unusable once a wait gave up; whether ranks own cores */
  /* hosts, agreed by all ranks at creation (the MPI transport's init,
   * transport/mpi/hosts.c): Adasum's groups and the thresholds read them */
  int host_min, host_max;  /* fewest and most ranks on one host */
  int hosts_consecutive;   /* every host's ranks are consecutive ranks */
  int64_t cma_bytes;       /* smallest message the host's ranks read from each other (0:
                            * never); the ranks validate it (comm/check.c) */
  /* The host transport's working state (bounce buffer, wire scratch, host
   * communicators, the peer-reading groups): opaque here, owned by
   * transport/mpi/ (its table's init and free slots), so no other layer
   * names its pieces. */
  void *host_state;
  /* The host's shared region when every rank is on one host (transport/shm/;
   * NULL: none): validation and small allreduces ride on it (comm/check.c). */
  struct gs_shm *shm;
};
enum { GS_PATH_NONE = 0, GS_PATH_NCCL = 1, GS_PATH_STAGED = 2, GS_PATH_CUDA_AWARE = 3 };
#define GS_COMM_MAGIC 0x67736331u /* "gsc1" */

/* One message's worth of statistics (gs_comm_get_stats). */
static inline void gs_count_message(gs_comm_t c, int64_t count, gs_dtype_t dtype) {
  c->stats.messages++;
  c->stats.bytes += (uint64_t)count * gs_dtype_size(dtype);
}

#endif
