/* The ranks of one host that read each other's memory (cma.c's groups):
 * made empty, probed collectively on first use, their scratch sized to the
 * core's cache, freed with their communicator. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport/mpi/gs_mpi_transport.h"

#define CMA_PROBE_MAGIC 0x676d61636d610000ull

/* cma.c's fold step's piece: the peer's piece, the running fold and the output's
 * piece stay inside the core's L2 together, so a piece is a quarter of it,
 * a power of two in [64 KiB, 512 KiB] (128 KiB where the size is unknown).
 * 256 KiB against 128 on a 1 MiB L2: 7.8-8.9 ms against 9.7-10.3 for
 * ResNet-50's list at 2 ranks (fewer system calls, each pinning more). */
#define CMA_PIECE_MIN ((int64_t)64 << 10)
#define CMA_PIECE_MAX ((int64_t)512 << 10)
#define CMA_PIECE_UNKNOWN ((int64_t)128 << 10)

static int64_t piece_bytes(void) {
  long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 <= 0) return CMA_PIECE_UNKNOWN;
  int64_t p = CMA_PIECE_MIN;
  while (p < CMA_PIECE_MAX && 8 * p <= (int64_t)l2) p *= 2;
  return p;
}

gs_status_t gs_cma_scratch(gs_cma_group_t *g) {
  if (g->scratch) return GS_SUCCESS;
  g->piece = piece_bytes();
  g->scratch = aligned_alloc(64, 2 * (size_t)g->piece);
  return g->scratch ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "allreduce: out of memory");
}

/* The probe's verdict, the same on every rank: the peers' process ids, or
 * the mechanism off, said once at debug level. */
static gs_status_t adopt(gs_cma_group_t *g, int every, const uint64_t *all, const char *call,
                         int why, int peer, int64_t from_bytes) {
  if (!every) {
    g->state = -1;
    if (peer >= 0)
      gs_log(GS_LOG_DEBUG,
             "allreduce in the host: this rank cannot read rank %d's memory "
             "(%s: %s); large allreduces go through MPI",
             peer, call, strerror(why));
    else
      gs_log(GS_LOG_DEBUG,
             "allreduce in the host: another rank cannot read its peers' "
             "memory; large allreduces go through MPI");
    return GS_SUCCESS;
  }
  g->pids = malloc((size_t)g->size * sizeof *g->pids);
  if (!g->pids) return gs_fail(GS_ERR_NO_MEMORY, "allreduce: out of memory");
  for (int r = 0; r < g->size; r++) g->pids[r] = (int64_t)all[2 * r];
  g->state = 1;
  gs_log(GS_LOG_DEBUG,
         "allreduce in the host: ranks read each other's memory "
         "(process_vm_readv) from %lld bytes",
         (long long)from_bytes);
  return GS_SUCCESS;
}

void gs_cma_group_reset(gs_cma_group_t *g, MPI_Comm mpi) {
  free(g->pids);
  free(g->scratch);
  free(g->blocks);
  free(g->asked);
  *g = (gs_cma_group_t){.mpi = mpi};
  if (mpi != MPI_COMM_NULL) {
    MPI_Comm_rank(mpi, &g->rank);
    MPI_Comm_size(mpi, &g->size);
  }
}

/* Collective over g: every rank reads one word from every other and writes
 * it back; any refusal turns the mechanism off on all of them. */
gs_status_t gs_cma_probe(gs_cma_group_t *g, int64_t from_bytes) {
  /* Yama's ptrace scope 1 lets only ancestors read a process: allow any
   * (no effect, EINVAL, without Yama). */
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  volatile uint64_t word = CMA_PROBE_MAGIC ^ (uint64_t)g->rank;
  uint64_t *all = malloc((size_t)g->size * 2 * sizeof *all);
  if (!all) return gs_fail(GS_ERR_NO_MEMORY, "allreduce: out of memory");
  all[2 * g->rank] = (uint64_t)getpid();
  all[2 * g->rank + 1] = (uint64_t)(uintptr_t)&word;
  MPI_Request req;
  int e = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, 2, MPI_UINT64_T, g->mpi, &req);
  gs_status_t s = e == MPI_SUCCESS ? gs_mpi_wait(&req, "allreduce: probing peer reads", NULL, NULL)
                                   : gs_mpi_fail(e, "allreduce: probing peer reads");
  int ok = 1, why = 0, peer = -1, every = 0;
  const char *call = "process_vm_readv";
  for (int r = 0; s == GS_SUCCESS && ok && r < g->size; r++) {
    uint64_t got = 0;
    struct iovec lv = {&got, sizeof got}, rv = {(void *)(uintptr_t)all[2 * r + 1], sizeof got};
    if (r == g->rank) continue;
    ok = process_vm_readv((pid_t)all[2 * r], &lv, 1, &rv, 1, 0) == (ssize_t)sizeof got &&
         got == (CMA_PROBE_MAGIC ^ (uint64_t)r);
    /* the allreduce writes too: the same word back (its owner never reads it) */
    if (ok && process_vm_writev((pid_t)all[2 * r], &lv, 1, &rv, 1, 0) != (ssize_t)sizeof got)
      ok = 0, call = "process_vm_writev";
    if (!ok) why = errno, peer = r;
  }
  /* `word` is read until every rank is past this point */
  if (s == GS_SUCCESS) {
    e = MPI_Iallreduce(&ok, &every, 1, MPI_INT, MPI_MIN, g->mpi, &req);
    s = e == MPI_SUCCESS ? gs_mpi_wait(&req, "allreduce: probing peer reads", NULL, NULL)
                         : gs_mpi_fail(e, "allreduce: probing peer reads");
  }
  if (s == GS_SUCCESS) s = adopt(g, every, all, call, why, peer, from_bytes);
  free(all);
  return s;
}
