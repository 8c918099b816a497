/* gradsync private, transport/mpi/: the MPI transport's own header: its host
 * algorithms (hosts.c, hierarchical.c, hier_wire.c, wire.c), the allreduce inside one
 * host reading the peers' memory (cma.c, cma_group.c, cma_pages.c), MPI's plumbing
 * (owned.c, mpi_xfer.c, state.c) and the device tables over MPI (cuda_aware.c, staged.c). */
#ifndef GRADSYNC_MPI_TRANSPORT_H
#define GRADSYNC_MPI_TRANSPORT_H

#include "transport/gs_transport.h"
#include "transport/mpi/gs_mpi_xfer.h"

/* Ranks of one host that read each other's memory (cma_group.c). */
typedef struct gs_cma_group {
  MPI_Comm mpi;  /* their communicator */
  int rank, size;
  int state;     /* 0 not probed yet, 1 usable, -1 refused somewhere */
  int64_t *pids; /* every rank's process id, once usable */
  char *scratch; /* two pieces: a peer's data, the running fold */
  int64_t piece; /* their size (cma_group.c) */
  uintptr_t *blocks;      /* 2 MiB blocks of this rank's tensors seen (cma_pages.c) */
  unsigned char *asked;   /* per block: gathered into a 2 MiB page already asked for */
  int64_t nblocks;
  int collapse;           /* the kernel gathers on request: 0 not asked yet, 1 yes, -1 no */
} gs_cma_group_t;

/* The MPI transport's working state, c->host_state: made by its table's init
 * (state.c) with the communicator, freed by its free slot. */
typedef struct gs_mpi_state {
  void *bounce; /* host memory MPI gets in place of the caller's (owned.c) */
  size_t bounce_bytes;
  void *wire_scratch; /* the wire allreduce's encoded segments in flight (wire.c) */
  size_t wire_scratch_bytes;
  int hier_mode;            /* GRADSYNC_HIERARCHICAL: -1 auto, 0 off, 1 on (hosts.c) */
  MPI_Comm hier_node;       /* this host's ranks; made on first use (hierarchical.c) */
  MPI_Comm hier_cross;      /* the ranks of my local rank on every host */
  int hier_group;           /* ranks per host they were made for (< 0: MPI's hosts) */
  int cma_hugepages;        /* persistent tensors gathered into 2 MiB pages (cma_pages.c) */
  gs_cma_group_t cma;       /* among all of the communicator's ranks (cma.c) */
  gs_cma_group_t hier_cma;  /* among hier_node's (the hierarchical allreduce's host stages) */
} gs_mpi_state_t;
static inline gs_mpi_state_t *gs_mpi_state(gs_comm_t c) { return (gs_mpi_state_t *)c->host_state; }

/* ---- hosts (hosts.c) and the hierarchical allreduce (hierarchical.c) ---- */

/* The table's init and free (state.c). init: collective over c->mpi, after
 * local_rank/local_size are set: the ranks agree on the hosts' sizes, and
 * the state is made (GRADSYNC_HIERARCHICAL, GRADSYNC_CMA_HUGEPAGES read). */
gs_status_t gs_mpi_init(gs_comm_t c);
gs_status_t gs_mpi_free(gs_comm_t c);
/* MPI's own allreduce, chunked, never touching the data: device pointers
 * may go in when MPI is CUDA-aware and the op is MPI's. */
gs_status_t gs_mpi_native_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                    gs_dtype_t dtype, gs_op_t op);
/* Ranks per host for the hierarchical algorithms (GRADSYNC_HIERARCHY_SIZE
 * if set), or 0 when the hosts hold unequal numbers of ranks. Every rank
 * gets the same answer. */
int gs_host_group(gs_comm_t c);
/* Whether an allreduce of `bytes` takes the hierarchical path (the same
 * answer on every rank). */
int gs_hier_wanted(gs_comm_t c, int64_t bytes);
/* reduce-scatter in the host, allreduce across hosts, allgather in the
 * host; send == NULL: in place on recv. */
gs_status_t gs_hier_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                              gs_dtype_t dtype, gs_op_t op);
/* The hierarchical allreduce moves a message in segments this large,
 * pipelined through its three phases (1 and 4 MiB measured alike at
 * 1 Gbit/s, 4 MiB ahead at 10); their counts and displacements fit MPI's
 * int. hosts.c decides when it is wanted, hierarchical.c runs it. */
#define GS_HIER_SEGMENT_BYTES ((int64_t)4 << 20)
void gs_hier_free(gs_comm_t c);
/* The host and cross-host communicators (c->hier_node, c->hier_cross) for
 * hosts of g ranks, made collectively on first use and kept. */
gs_status_t gs_hier_comms(gs_comm_t c, int g);

/* ---- the allreduce inside one host, reading the peers' memory (cma.c) ---- */

/* Whether the communicator's ranks read each other's memory for a message
 * of `bytes`: every rank on one host, from GRADSYNC_CMA_BYTES up, unless a
 * probe found it refused (the same answer on every rank). The route asks
 * the hierarchical predicate itself; gs_cma_wanted adds it (the
 * reduce-scatter, the allgather, the staged chunks). */
int gs_cma_reads(gs_comm_t c, int64_t bytes);
int gs_cma_wanted(gs_comm_t c, int64_t bytes);
/* The MPI transport's allreduce_segments: reduce-scatter by slices read
 * from the peers, then an allgather of the reduced slices; *taken = 0 when
 * not wanted or refused (probed collectively at the first call). */
gs_status_t gs_cma_allreduce(gs_comm_t c, const gs_seg_t *in, const gs_seg_t *out, int64_t nseg,
                             gs_dtype_t dtype, gs_op_t op, double pre, double post, int *taken);
/* The same two phases alone, for the MPI transport's reduce_scatter and
 * allgatherv (their layouts); *taken = 0 as above. */
gs_status_t gs_cma_reduce_scatter(gs_comm_t c, const void *send, void *recv, const int64_t *counts,
                                  gs_dtype_t dtype, gs_op_t op, int *taken);
gs_status_t gs_cma_allgatherv(gs_comm_t c, void *recv, const int64_t *counts, const int64_t *displs,
                              gs_dtype_t dtype, int *taken);
/* The hierarchical allreduce's host stages (hierarchical.c): the same two
 * phases among c->hier_node's ranks (c->hier_cma), whose blocks' counts and
 * displacements they take; gs_cma_host_wanted says whether a segment of
 * `bytes` is read so. */
int gs_cma_host_wanted(gs_comm_t c, int64_t bytes);
gs_status_t gs_cma_host_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                       const int64_t *counts, gs_dtype_t dtype, gs_op_t op,
                                       int *taken);
gs_status_t gs_cma_host_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                   const int64_t *displs, gs_dtype_t dtype, int *taken);
/* The same two phases on a message's memory where it lies (the wire
 * path's host stages, hier_wire.c): the reduce-scatter reads every rank's
 * `in` segments and writes this rank's block (counts[rank] elements, the
 * blocks back to back) to recv; the allgather reads each rank's block from
 * its `from` and writes every block into this rank's `out` segments. */
gs_status_t gs_cma_host_reduce_scatter_segs(gs_comm_t c, const gs_seg_t *in, int64_t nseg,
                                            void *recv, const int64_t *counts, gs_dtype_t dtype,
                                            gs_op_t op, int *taken);
gs_status_t gs_cma_host_allgather_segs(gs_comm_t c, const void *from, const gs_seg_t *out,
                                       int64_t nseg, const int64_t *counts, gs_dtype_t dtype,
                                       int *taken);
/* Before a call's copies: the 2 MiB blocks wholly inside `segs` (memory
 * the call writes, so resident after it) that an earlier call saw too are
 * gathered into 2 MiB pages, once (peer copies then pin one page per
 * block, not 512); cma_pages.c. */
void gs_cma_settle_pages(gs_comm_t c, gs_cma_group_t *g, const gs_seg_t *segs, int64_t nseg,
                         size_t es);
/* The groups (cma_group.c, down to gs_cma_scratch). A group for `mpi`'s
 * ranks, not probed yet (MPI_COMM_NULL: none); what the group held before
 * is freed. */
void gs_cma_group_reset(gs_cma_group_t *g, MPI_Comm mpi);
/* Collective over g: every rank reads one word from every other and writes
 * it back; any refusal turns the reads off on all of them (cma_group.c). */
gs_status_t gs_cma_probe(gs_cma_group_t *g, int64_t from_bytes);
/* g's two scratch pieces (g->scratch), g->piece bytes each, made once. */
gs_status_t gs_cma_scratch(gs_cma_group_t *g);

/* ---- the allreduce in a low-precision wire format (wire.c) -------------- */

gs_status_t gs_wire_hook(const gs_wire_hooks_t *hooks, int finish, int64_t first, int64_t n);

/* x (count float32 values, host memory) becomes the sum over mc's ranks,
 * times post, each input rounded once to `wire` and the result once: a
 * direct exchange of encoded shards, float32 sums in rank order at each
 * shard's owner, an allgather of the rounded shards. lost (may be NULL):
 * += this rank's input rounding, plus its own shard's output rounding
 * divided by post (error feedback). Every rank of mc gets the same bits.
 * hooks (may be NULL): as above. */
gs_status_t gs_wire_allreduce(gs_comm_t c, MPI_Comm mc, float *x, int64_t count, gs_wire_t wire,
                              double post, float *lost, const gs_wire_hooks_t *hooks);

/* One segment's crossing in three nonblocking steps, for pipelines (this
 * file's and hier_wire.c's): begin encodes and starts the exchange, middle
 * waits for it, reduces and starts the allgather, end waits and decodes.
 * Segment k uses slot k % GS_WIRE_DEPTH, so up to that many segments are
 * between begin and end at once; segments hold at most the `seg` elements
 * gs_wire_run_open was given. The scratch is the communicator's. */
#define GS_WIRE_DEPTH 3
typedef struct gs_wire_slot {
  float *x, *lost;
  int64_t n;
  MPI_Request req;
  int *bytes, *displs, *rbytes, *rdispls; /* per rank: its shard's wire bytes, where they lie */
  char *packed, *recv; /* every shard encoded (sent, then gathered); P copies of mine */
  float *acc;
} gs_wire_slot_t;
typedef struct gs_wire_run {
  gs_comm_t c;
  MPI_Comm mc;
  int p, r;
  gs_wire_t wire;
  float post;
  gs_wire_slot_t slot[GS_WIRE_DEPTH];
} gs_wire_run_t;
gs_status_t gs_wire_run_open(gs_wire_run_t *w, gs_comm_t c, MPI_Comm mc, gs_wire_t wire,
                             double post, int64_t seg);
gs_status_t gs_wire_begin(gs_wire_run_t *w, int64_t k, float *x, int64_t n, float *lost);
gs_status_t gs_wire_middle(gs_wire_run_t *w, int64_t k);
gs_status_t gs_wire_end(gs_wire_run_t *w, int64_t k);
/* gs_wire_allreduce over c's hosts: float32 inside each host, the wire
 * format across them (hier_wire.c). */
gs_status_t gs_hier_wire_allreduce(gs_comm_t c, float *x, int64_t count, gs_wire_t wire,
                                   double post, float *lost, const gs_wire_hooks_t *hooks);

/* ---- the memory MPI is handed (owned.c) ----------------------------------- */

/* Broadcasts and exchanges go through it in pieces of at most this. */
#define GS_BOUNCE_PIECE_BYTES ((int64_t)4 << 20)
/* Whether [p, p + bytes) lies in memory the communicator keeps (the
 * fusion buffer, scratch, staging, the bounce buffer): MPI may have it. */
int gs_mpi_owned(gs_comm_t c, const void *p, size_t bytes);
/* *buf grown to at least `bytes` (64-byte aligned, gs_grow_size; contents
 * not kept): the one growth of the host buffers MPI is handed. */
gs_status_t gs_owned_grow(void **buf, size_t *have, size_t bytes, const char *what);
/* The bounce buffer, at least `bytes` long; it replaces the last one. */
gs_status_t gs_bounce_reserve(gs_comm_t c, size_t bytes, void **buf);

#endif
