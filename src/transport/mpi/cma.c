/* The allreduce inside one host by cross-memory attach (docs/DESIGN.md section 15).
 *
 * MPI's shared-memory path copies every byte into a cell and out again
 * (about 5.5 times the message per rank at 2 ranks). Here each rank reads
 * and writes its peers' memory where it lies, with Linux's
 * process_vm_readv and process_vm_writev:
 *
 *   1. the ranks exchange the addresses of their inputs and outputs (the
 *      message's segments: a fused list's tensors, each where it is);
 *   2. rank r owns slice r of the message and folds every rank's slice r
 *      into its own output, a cache-sized piece at a time (a peer's piece
 *      is read into a scratch piece, then reduced while both are in
 *      cache), and writes each reduced piece, still in cache, into every
 *      peer's output (the allreduce; the reduce-scatter alone stops at the
 *      fold, and the allgather alone reads the owners' slices).
 *
 * Per rank the allreduce touches about 2 times the message (the peers'
 * share of its slice read, its own read and written, the result written
 * to the peers), docs/decisions/transport.md has the counts. Each slice is reduced
 * by one rank, in rank order (x0 op x1 op ... from the left), and copied
 * to the others, so every rank holds the same bits; at 2 ranks that is
 * MPI's x0 op x1. Nobody else touches slice r in any process while its
 * owner works on it (the owner alone reads every rank's slice r, and
 * writes it only after reading it), so in place is safe.
 *
 * Synchronisation is small MPI collectives: the address exchange (every
 * rank has entered, its inputs are ready) and an agreement after each
 * phase, which completes only when every rank has finished it, so no rank
 * reads memory a peer may still write, and no rank returns (and frees or
 * reuses its memory) while a peer may still read or write it. The
 * agreements carry each rank's copy errors, so a failed copy (a peer gone:
 * ESRCH) fails the call on every rank, and a dead peer leaves the others
 * in an MPI wait that ends in its timeout: never a copy of freed memory
 * reported as success. No memory is shared, so nothing is ever left in
 * /dev/shm.
 *
 * Whether the ranks may read each other (ptrace rules, a container's
 * seccomp filter without CMA) is probed collectively at the first call that
 * wants it (cma_group.c); a refusal anywhere turns it off for the
 * communicator, logged once at debug level, and the calls go through MPI
 * as before. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport/mpi/gs_mpi_transport.h"

/* iovecs per system call (Linux's IOV_MAX is 1024). */
#define CMA_IOV 256

typedef struct cma_call {
  gs_comm_t c;
  gs_cma_group_t *g; /* the ranks that read each other (their ranks, pids, scratch) */
  int64_t nseg, count;
  const int64_t *offs; /* nseg + 1 prefix sums of the segments' counts */
  const uint64_t *at;  /* per rank: nseg input addresses, then nseg output addresses */
  size_t es;
  gs_dtype_t dtype;
  gs_op_t op;
  double pre, post;    /* each input's scale (rounded to the dtype), the result's */
  const int64_t *counts, *displs; /* the ranks' slices (NULL: even; displs NULL: back to back) */
  char *fold, *peer;   /* scratch pieces */
  int64_t piece;       /* their size in bytes */
  int push;            /* the owner writes its reduced slice into every peer's outputs */
  int out_stands_in;   /* `out` is addressed as the whole message but is this rank's block */
  int err_no, err_peer;
} cma_call_t;

enum { CMA_IN = 0, CMA_OUT = 1 };

static const uint64_t *table(const cma_call_t *k, int rank, int which) {
  return k->at + ((size_t)rank * 2 + (size_t)which) * (size_t)k->nseg;
}

/* Whether a message of `bytes` is read among g's ranks (not yet refused). */
static int group_wanted(gs_comm_t c, const gs_cma_group_t *g, int64_t bytes) {
  return g->size > 1 && g->state >= 0 && c->cma_bytes > 0 && bytes >= c->cma_bytes;
}

/* The communicator's own group (its ranks, as they are now). */
static gs_cma_group_t *whole(gs_comm_t c) {
  gs_cma_group_t *g = &gs_mpi_state(c)->cma;
  g->mpi = c->mpi;
  g->rank = c->rank;
  g->size = c->size;
  return g;
}

int gs_cma_reads(gs_comm_t c, int64_t bytes) {
  return c->host_max == c->size && group_wanted(c, whole(c), bytes);
}

int gs_cma_wanted(gs_comm_t c, int64_t bytes) {
  return gs_cma_reads(c, bytes) && !gs_hier_wanted(c, bytes);
}

int gs_cma_host_wanted(gs_comm_t c, int64_t bytes) {
  const gs_cma_group_t *g = &gs_mpi_state(c)->hier_cma;
  return g->mpi != MPI_COMM_NULL && group_wanted(c, g, bytes);
}

/* The segment holding message element `e` (the last one starting at or before it). */
static int64_t segment_of(const cma_call_t *k, int64_t e) {
  int64_t lo = 0, hi = k->nseg - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (k->offs[mid] <= e) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* iovecs over message elements [first, first + count) of a rank's segments
 * (`at`: their addresses), at most CMA_IOV; *covered: the elements they hold.
 * Every rank's segments have the same counts, so two ranks' lists for one
 * range pair up iovec by iovec. */
static int iovs(const cma_call_t *k, const uint64_t *at, int64_t first, int64_t count,
                struct iovec *v, int64_t *covered) {
  int n = 0;
  int64_t done = 0;
  for (int64_t s = segment_of(k, first); done < count && n < CMA_IOV && s < k->nseg; s++) {
    int64_t from = first + done, take = k->offs[s + 1] - from;
    if (take > count - done) take = count - done;
    if (take <= 0) continue;
    v[n].iov_base = (char *)(uintptr_t)at[s] + (size_t)(from - k->offs[s]) * k->es;
    v[n].iov_len = (size_t)take * k->es;
    n++;
    done += take;
  }
  *covered = done;
  return n;
}

/* Copies elements [first, first + count) of `rank`'s segments (which: its
 * inputs or outputs) into `dst` (contiguous) or, when dst is NULL, into the
 * same elements of this rank's outputs; push: the other way, this rank's
 * outputs into `rank`'s (which: CMA_OUT). Records the first failure. */
static int peer_copy(cma_call_t *k, int rank, int which, int64_t first, int64_t count, char *dst,
                     int push) {
  pid_t pid = (pid_t)k->g->pids[rank];
  while (count > 0 && !k->err_no) {
    struct iovec rv[CMA_IOV], lv[CMA_IOV];
    int64_t got = 0, mine = 0;
    int nr = iovs(k, table(k, rank, which), first, count, rv, &got), nl = 1;
    if (dst) lv[0] = (struct iovec){dst, (size_t)got * k->es};
    else nl = iovs(k, table(k, k->g->rank, CMA_OUT), first, got, lv, &mine);
    ssize_t b = push ? process_vm_writev(pid, lv, (unsigned long)nl, rv, (unsigned long)nr, 0)
                     : process_vm_readv(pid, lv, (unsigned long)nl, rv, (unsigned long)nr, 0);
    int64_t moved = b > 0 ? (int64_t)((size_t)b / k->es) : 0;
    if (moved == 0) { /* a partial copy resumes; none at all is the peer's fault */
      k->err_no = b < 0 ? errno : EFAULT;
      k->err_peer = rank;
      return -1;
    }
    first += moved;
    count -= moved;
    if (dst) dst += (size_t)moved * k->es;
  }
  return k->err_no ? -1 : 0;
}

static int read_peer(cma_call_t *k, int rank, int which, int64_t first, int64_t count, char *dst) {
  return peer_copy(k, rank, which, first, count, dst, 0);
}

/* On this rank's outputs over [first, first + count): `src` (contiguous)
 * folded in (out = src op out), or, src NULL, the inputs copied there
 * (out of place) or the post scale applied. */
enum { CMA_FOLD, CMA_COPY_IN, CMA_SCALE };
static void local_pass(cma_call_t *k, int what, const char *src, int64_t first, int64_t count,
                       double post) {
  while (count > 0) {
    struct iovec out[CMA_IOV], in[CMA_IOV];
    int64_t got = 0, same = 0;
    int n = iovs(k, table(k, k->g->rank, CMA_OUT), first, count, out, &got);
    if (what == CMA_COPY_IN) iovs(k, table(k, k->g->rank, CMA_IN), first, got, in, &same);
    for (int i = 0; i < n; i++) {
      int64_t len = (int64_t)(out[i].iov_len / k->es);
      if (what == CMA_FOLD) {
        gs_cpu_reduce(k->dtype, k->op, src, out[i].iov_base, len);
        src += out[i].iov_len;
      } else if (what == CMA_COPY_IN && in[i].iov_base != out[i].iov_base) {
        memcpy(out[i].iov_base, in[i].iov_base, out[i].iov_len);
      } else if (what == CMA_SCALE) {
        gs_cpu_scale_copy(k->dtype, out[i].iov_base, out[i].iov_base, len, post);
      }
    }
    first += got;
    count -= got;
  }
}

/* Slice r of the message: the caller's blocks (counts, at displs or back to
 * back), else whole cache lines, the last slices possibly empty. */
static void slice(const cma_call_t *k, int r, int64_t *first, int64_t *count) {
  if (k->counts) {
    int64_t at = 0;
    for (int q = 0; q < r && !k->displs; q++) at += k->counts[q];
    *first = k->displs ? k->displs[r] : at;
    *count = k->counts[r];
    return;
  }
  int64_t line = 64 / (int64_t)k->es, p = k->g->size;
  int64_t per = (k->count + p - 1) / p;
  per = (per + line - 1) / line * line;
  int64_t lo = per * r < k->count ? per * r : k->count;
  int64_t hi = lo + per < k->count ? lo + per : k->count;
  *first = lo;
  *count = hi - lo;
}

/* One piece of this rank's slice: x0 op x1 op ... op x(p-1) from the left.
 * The ranks below this one fold into scratch first; its own values (in its
 * output) join next, then the ranks above, one by one, in place. */
static void reduce_piece(cma_call_t *k, int64_t first, int64_t n) {
  int me = k->g->rank;
  local_pass(k, CMA_COPY_IN, NULL, first, n, 1.0);
  if (k->pre != 1.0) local_pass(k, CMA_SCALE, NULL, first, n, k->pre);
  for (int r = 0; r < me && !k->err_no; r++) {
    char *to = r == 0 ? k->fold : k->peer;
    if (read_peer(k, r, CMA_IN, first, n, to)) return;
    if (k->pre != 1.0) gs_cpu_scale_copy(k->dtype, to, to, n, k->pre);
    if (r > 0) gs_cpu_reduce(k->dtype, k->op, k->peer, k->fold, n);
  }
  if (me > 0) local_pass(k, CMA_FOLD, k->fold, first, n, 1.0);
  for (int r = me + 1; r < k->g->size && !k->err_no; r++) {
    if (read_peer(k, r, CMA_IN, first, n, k->peer)) return;
    if (k->pre != 1.0) gs_cpu_scale_copy(k->dtype, k->peer, k->peer, n, k->pre);
    local_pass(k, CMA_FOLD, k->peer, first, n, 1.0);
  }
  if (k->post != 1.0) local_pass(k, CMA_SCALE, NULL, first, n, k->post);
  /* the allreduce hands the piece, still in cache, to every peer at once */
  for (int r = 1; k->push && r < k->g->size && !k->err_no; r++)
    peer_copy(k, (me + r) % k->g->size, CMA_OUT, first, n, NULL, 1);
}

/* Completes when every rank has finished the phase before; fails on every
 * rank when a read failed on any. */
static gs_status_t agree(cma_call_t *k, const char *phase) {
  int mine = k->err_no != 0, any = 0;
  MPI_Request req;
  GS_MPI_CHECK(MPI_Iallreduce(&mine, &any, 1, MPI_INT, MPI_MAX, k->g->mpi, &req), phase);
  GS_CHECK(gs_mpi_wait(&req, phase, NULL, NULL));
  if (k->err_no)
    return gs_fail(GS_ERR_MPI, "%s: reading rank %d's memory (process_vm_readv): %s", phase,
                   k->err_peer, strerror(k->err_no));
  if (any)
    return gs_fail(GS_ERR_MPI,
                   "%s: another rank could not read a peer's memory "
                   "(process_vm_readv); its error names the peer",
                   phase);
  return GS_SUCCESS;
}

/* The scratch pieces, kept per group (cma_group.c sizes them). */
static gs_status_t scratch(gs_cma_group_t *g, cma_call_t *k) {
  GS_CHECK(gs_cma_scratch(g));
  k->piece = g->piece;
  k->fold = g->scratch;
  k->peer = k->fold + g->piece;
  return GS_SUCCESS;
}

/* Every rank's segment addresses, inputs then outputs (in == NULL: in place). */
static gs_status_t exchange(gs_cma_group_t *g, const gs_seg_t *in, const gs_seg_t *out, int64_t n,
                            uint64_t *all) {
  uint64_t *mine = all + (size_t)g->rank * 2 * (size_t)n;
  for (int64_t s = 0; s < n; s++) {
    mine[s] = (uint64_t)(uintptr_t)(in ? in[s].at : out[s].at);
    mine[n + s] = (uint64_t)(uintptr_t)out[s].at;
  }
  MPI_Request req;
  GS_MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, (int)(2 * n), MPI_UINT64_T,
                              g->mpi, &req),
               "allreduce (in the host): exchanging addresses");
  return gs_mpi_wait(&req, "allreduce (in the host): exchanging addresses", NULL, NULL);
}

/* The call's tables: the segments' offsets, every rank's addresses
 * (exchanged) and the scratch pieces; *taken = 0, nothing done, when the
 * reads are not wanted or refused. `name` names the call in errors. */
static gs_status_t open_call(cma_call_t *k, const gs_seg_t *in, const gs_seg_t *out,
                             const char *name, int *taken) {
  gs_comm_t c = k->c;
  gs_cma_group_t *g = k->g;
  *taken = 0;
  int64_t *offs = malloc(((size_t)k->nseg + 1) * sizeof *offs);
  if (!offs) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", name);
  offs[0] = 0;
  for (int64_t s = 0; s < k->nseg; s++) offs[s + 1] = offs[s] + out[s].count;
  k->offs = offs;
  k->count = offs[k->nseg];
  int64_t bytes = k->count * (int64_t)k->es;
  /* this call's bytes against the threshold; the hierarchical question was the route's */
  int wanted = g == &gs_mpi_state(c)->cma ? gs_cma_reads(c, bytes) : gs_cma_host_wanted(c, bytes);
  if (!wanted || 2 * k->nseg > INT32_MAX) return GS_SUCCESS;
  if (g->state == 0) GS_CHECK(gs_cma_probe(g, c->cma_bytes));
  if (g->state < 0) return GS_SUCCESS;
  uint64_t *all = malloc((size_t)g->size * 2 * (size_t)k->nseg * sizeof *all);
  if (!all) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", name);
  k->at = all;
  *taken = 1;
  c->stats.peer_reads++;
  /* only memory this call really writes (resident after it) is gathered */
  if (!k->out_stands_in) gs_cma_settle_pages(c, g, out, k->nseg, k->es);
  GS_CHECK(exchange(g, in, out, k->nseg, all));
  return scratch(g, k);
}

static void close_call(cma_call_t *k) {
  free((void *)k->offs);
  free((void *)k->at);
}

/* Reduce-scatter: this rank's slice, folded piece by piece. */
static void reduce_slice(cma_call_t *k) {
  int64_t lo, n, piece = k->piece / (int64_t)k->es;
  slice(k, k->g->rank, &lo, &n);
  for (int64_t at = lo; at < lo + n && !k->err_no; at += piece)
    reduce_piece(k, at, lo + n - at < piece ? lo + n - at : piece);
}

/* Allgather: every other slice, from its owner's outputs (which: or its
 * inputs) into this rank's outputs. */
static void gather_slices(cma_call_t *k, int which) {
  int64_t lo, n;
  for (int r = 1; r < k->g->size && !k->err_no; r++) {
    int peer = (k->g->rank + r) % k->g->size; /* ranks start at different owners */
    slice(k, peer, &lo, &n);
    read_peer(k, peer, which, lo, n, NULL);
  }
}

gs_status_t gs_cma_allreduce(gs_comm_t c, const gs_seg_t *in, const gs_seg_t *out, int64_t nseg,
                             gs_dtype_t dtype, gs_op_t op, double pre, double post, int *taken) {
  cma_call_t k = {.c = c,
                  .g = whole(c),
                  .nseg = nseg,
                  .es = gs_dtype_size(dtype),
                  .dtype = dtype,
                  .op = op,
                  .pre = pre,
                  .post = post,
                  .push = 1};
  gs_status_t s = open_call(&k, in, out, "allreduce", taken);
  if (s == GS_SUCCESS && *taken) {
    reduce_slice(&k);
    s = agree(&k, "allreduce (in the host)");
  }
  close_call(&k);
  return s;
}

/* Reduce-scatter among g's ranks: this rank's block of the sum into recv. */
static gs_status_t reduce_scatter(gs_comm_t c, gs_cma_group_t *g, const void *send, void *recv,
                                  const int64_t *counts, gs_dtype_t dtype, gs_op_t op, int *taken) {
  int64_t total = 0, mine = 0;
  for (int r = 0; r < g->size; r++) {
    if (r == g->rank) mine = total;
    total += counts[r];
  }
  cma_call_t k = {.c = c,
                  .g = g,
                  .nseg = 1,
                  .es = gs_dtype_size(dtype),
                  .dtype = dtype,
                  .op = op,
                  .pre = 1.0,
                  .post = 1.0,
                  .counts = counts,
                  .out_stands_in = 1};
  /* this rank's output holds its block only: addressed as if it were the
   * whole message (uintptr_t arithmetic: no pointer outside an object) */
  gs_seg_t in = {(void *)send, total},
           out = {(void *)((uintptr_t)recv - (uintptr_t)mine * k.es), total};
  gs_status_t s = open_call(&k, &in, &out, "reduce_scatter", taken);
  if (s == GS_SUCCESS && *taken) {
    reduce_slice(&k);
    s = agree(&k, "reduce_scatter (in the host)");
  }
  close_call(&k);
  return s;
}

/* Allgather among g's ranks: every other rank's block read into recv. */
static gs_status_t allgatherv(gs_comm_t c, gs_cma_group_t *g, void *recv, const int64_t *counts,
                              const int64_t *displs, gs_dtype_t dtype, int *taken) {
  int64_t end = 0;
  for (int r = 0; r < g->size; r++)
    if (counts[r] > 0 && displs[r] + counts[r] > end) end = displs[r] + counts[r];
  cma_call_t k = {.c = c,
                  .g = g,
                  .nseg = 1,
                  .es = gs_dtype_size(dtype),
                  .dtype = dtype,
                  .pre = 1.0,
                  .post = 1.0,
                  .counts = counts,
                  .displs = displs};
  gs_seg_t out = {recv, end};
  gs_status_t s = open_call(&k, NULL, &out, "allgather", taken);
  if (s == GS_SUCCESS && *taken) {
    gather_slices(&k, CMA_OUT);
    s = agree(&k, "allgather (in the host)");
  }
  close_call(&k);
  return s;
}

/* Segments as `like`'s (their counts), addressed contiguously from `base`,
 * where element `mine` of the message lies (uintptr_t arithmetic: the
 * other elements' addresses are never used, nor formed as pointers). */
static gs_seg_t *contiguous_like(const gs_seg_t *like, int64_t nseg, const void *base, int64_t mine,
                                 size_t es) {
  gs_seg_t *v = malloc((size_t)(nseg > 0 ? nseg : 1) * sizeof *v);
  uintptr_t at = (uintptr_t)base - (uintptr_t)mine * es;
  for (int64_t s = 0; v && s < nseg; s++) {
    v[s] = (gs_seg_t){(void *)at, like[s].count};
    at += (uintptr_t)like[s].count * es;
  }
  return v;
}

/* The host stages on a message where it lies (gather 0: `segs` are the
 * inputs, this rank's block goes to `block`; gather 1: `segs` are the
 * outputs, each rank's block comes from its `block`). */
static gs_status_t host_segs(gs_comm_t c, const gs_seg_t *segs, int64_t nseg, void *block,
                             const int64_t *counts, gs_dtype_t dtype, gs_op_t op, int gather,
                             int *taken) {
  gs_cma_group_t *g = &gs_mpi_state(c)->hier_cma;
  const char *name = gather ? "allgather" : "reduce_scatter";
  const char *phase = gather ? "allgather (in the host)" : "reduce_scatter (in the host)";
  int64_t mine = 0;
  for (int r = 0; r < g->rank; r++) mine += counts[r];
  cma_call_t k = {.c = c,
                  .g = g,
                  .nseg = nseg,
                  .es = gs_dtype_size(dtype),
                  .dtype = dtype,
                  .op = op,
                  .pre = 1.0,
                  .post = 1.0,
                  .counts = counts};
  gs_seg_t *other = contiguous_like(segs, nseg, block, mine, k.es);
  if (!other) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", phase);
  k.out_stands_in = !gather; /* the reduce-scatter's output is `block` alone */
  gs_status_t s =
      gather ? open_call(&k, other, segs, name, taken) : open_call(&k, segs, other, name, taken);
  if (s == GS_SUCCESS && *taken) {
    if (gather) {
      int64_t lo, n;
      slice(&k, g->rank, &lo, &n);
      local_pass(&k, CMA_COPY_IN, NULL, lo, n, 1.0); /* this rank's own block */
      gather_slices(&k, CMA_IN);
    } else {
      reduce_slice(&k);
    }
    s = agree(&k, phase);
  }
  close_call(&k);
  free(other);
  return s;
}

gs_status_t gs_cma_host_reduce_scatter_segs(gs_comm_t c, const gs_seg_t *in, int64_t nseg,
                                            void *recv, const int64_t *counts, gs_dtype_t dtype,
                                            gs_op_t op, int *taken) {
  return host_segs(c, in, nseg, recv, counts, dtype, op, 0, taken);
}

gs_status_t gs_cma_host_allgather_segs(gs_comm_t c, const void *from, const gs_seg_t *out,
                                       int64_t nseg, const int64_t *counts, gs_dtype_t dtype,
                                       int *taken) {
  return host_segs(c, out, nseg, (void *)from, counts, dtype, GS_OP_SUM, 1, taken);
}

gs_status_t gs_cma_reduce_scatter(gs_comm_t c, const void *send, void *recv, const int64_t *counts,
                                  gs_dtype_t dtype, gs_op_t op, int *taken) {
  return reduce_scatter(c, whole(c), send, recv, counts, dtype, op, taken);
}

gs_status_t gs_cma_allgatherv(gs_comm_t c, void *recv, const int64_t *counts, const int64_t *displs,
                              gs_dtype_t dtype, int *taken) {
  return allgatherv(c, whole(c), recv, counts, displs, dtype, taken);
}

gs_status_t gs_cma_host_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                       const int64_t *counts, gs_dtype_t dtype, gs_op_t op,
                                       int *taken) {
  return reduce_scatter(c, &gs_mpi_state(c)->hier_cma, send, recv, counts, dtype, op, taken);
}

gs_status_t gs_cma_host_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                   const int64_t *displs, gs_dtype_t dtype, int *taken) {
  return allgatherv(c, &gs_mpi_state(c)->hier_cma, recv, counts, displs, dtype, taken);
}
