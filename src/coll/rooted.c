/* Rooted collectives: gather and scatter with per-rank counts (each tensor
 * its own message), and reduce to a root (fused like allreduce, with the same
 * scaling arithmetic). Every rank passes the same counts; their hash per
 * tensor is part of the validated signature, so ranks that disagree about
 * any rank's count fail together before data moves, and all ranks can pick
 * the same MPI algorithm from counts they all hold. */
#include <stdlib.h>

#include "coll/gs_collective.h"

/* Per tensor: a hash of its column of counts (the validated `extra`), and
 * whether every count and displacement fits one MPI call. */
static gs_status_t column_hashes(const char *fn, const int64_t *counts, int64_t n, int p,
                                 int64_t *hash, int *native) {
  int64_t limit = gs_env_mpi_max_count();
  *native = 1;
  for (int64_t i = 0; i < n; i++) {
    uint64_t h = 0x726f6f746564ull;
    int64_t sum;
    GS_CHECK(gs_check_column(fn, "counts", counts, n, p, i, &sum, &h));
    if (sum > limit) *native = 0;
    hash[i] = (int64_t)(h & 0x3fffffffffffffffull);
  }
  return GS_SUCCESS;
}

static gs_status_t check_root(const char *fn, gs_comm_t c, int root) {
  if (root < 0 || root >= c->size)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: root %d is not a rank of a communicator of "
                   "size %d",
                   fn, root, c->size);
  return GS_SUCCESS;
}

/* t[i].count must be the sum of its column (whole) or this rank's entry. */
static gs_status_t check_sizes(const char *fn, const char *name, const gs_tensor_t *t,
                               const int64_t *counts, int64_t n, gs_comm_t c, int whole) {
  for (int64_t i = 0; i < n; i++) {
    int64_t want = 0;
    for (int r = 0; r < c->size; r++)
      if (whole || r == c->rank) want += counts[(size_t)r * n + i];
    if (t[i].count != want)
      return gs_fail(GS_ERR_INVALID_ARGUMENT,
                     "%s: %s[%lld] has %lld elements; counts say %s "
                     "%lld",
                     fn, name, (long long)i, (long long)t[i].count,
                     whole ? "all ranks' blocks add up to" : "this rank's block has",
                     (long long)want);
  }
  return GS_SUCCESS;
}

static gs_status_t check_pair_dtypes(const char *fn, const gs_tensor_t *in, const gs_tensor_t *out,
                                     int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (out[i].dtype != in[i].dtype)
      return gs_fail(GS_ERR_TYPE, "%s: out[%lld] is %s but in[%lld] is %s", fn, (long long)i,
                     gs_dtype_name(out[i].dtype), (long long)i, gs_dtype_name(in[i].dtype));
  return GS_SUCCESS;
}

/* The arguments of a gather (gather != 0) or scatter: `mine` is the list
 * every rank holds (gather: in, scatter: out), `whole` the root's. */
static gs_status_t check_rooted(const char *fn, gs_comm_t c, const gs_tensor_t *mine,
                                const gs_tensor_t *whole, int64_t n, const int64_t *counts,
                                int root, int gather, int64_t *hash, int *native) {
  GS_CHECK(gs_check_tensors(fn, gather ? "in" : "out", mine, n));
  GS_CHECK(check_root(fn, c, root));
  if (n > 0 && !counts) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts is NULL", fn);
  GS_CHECK(column_hashes(fn, counts, n, c->size, hash, native));
  GS_CHECK(check_sizes(fn, gather ? "in" : "out", mine, counts, n, c, 0));
  if (c->rank != root) return gs_check_memory(c, fn, mine, n, NULL, 0);
  GS_CHECK(gs_check_tensors(fn, gather ? "out" : "in", whole, n));
  GS_CHECK(check_pair_dtypes(fn, gather ? mine : whole, gather ? whole : mine, n));
  GS_CHECK(check_sizes(fn, gather ? "out" : "in", whole, counts, n, c, 1));
  GS_CHECK(gs_check_disjoint(fn, gather ? mine : whole, gather ? whole : mine, n));
  return gs_check_memory(c, fn, mine, n, whole, n);
}

/* What a gather or scatter found in its checks. */
typedef struct rooted {
  int gather, native;
  int64_t *hash; /* per tensor: its column of counts */
} rooted_t;

static void rooted_release(gs_coll_t *d) {
  rooted_t *r = d->extra;
  free(r->hash);
  r->hash = NULL;
}

/* Rank-dependent: only the root reads the whole list. */
static gs_status_t rooted_check(gs_comm_t c, gs_coll_t *d) {
  rooted_t *r = d->extra;
  if (d->n < 0) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: n is negative", d->fn);
  r->hash = malloc((size_t)(d->n > 0 ? d->n : 1) * sizeof *r->hash);
  if (!r->hash) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  GS_CHECK(check_rooted(d->fn, c, d->in, d->out, d->n, d->counts, d->root, r->gather, r->hash,
                        &r->native));
  d->call.extra = r->hash;
  d->call.extra_name = "per-rank counts (hash)";
  d->call.counts_vary = 1;
  return GS_SUCCESS;
}

/* Each tensor its own message; the root's counts and displacements. */
static gs_status_t rooted_run(const gs_engine_t *e, gs_coll_t *d) {
  const rooted_t *rt = d->extra;
  gs_comm_t c = e->comm;
  int p = c->size, me = c->rank == d->root;
  int64_t n = d->n;
  const gs_tensor_t *mine = d->in, *whole = d->out;
  int64_t *v = malloc(2 * (size_t)p * sizeof *v);
  gs_status_t s = v ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", d->fn);
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    gs_xfer_t x = {mine[i].dtype, d->root, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, rt->native};
    for (int r = 0; me && r < p; r++) {
      v[r] = d->counts[(size_t)r * n + i];
      v[p + r] = r ? v[p + r - 1] + v[r - 1] : 0;
    }
    if (rt->gather) {
      x.send = mine[i].data, x.scount = mine[i].count;
      if (me) x.recv = whole[i].data, x.rcounts = v, x.rdispls = v + p;
      s = gs_xfer_gatherv(e, &x);
    } else {
      x.recv = mine[i].data, x.rcount = mine[i].count;
      if (me) x.send = whole[i].data, x.scounts = v, x.sdispls = v + p;
      s = gs_xfer_scatterv(e, &x);
    }
  }
  free(v);
  return s;
}

/* `mine` is the list every rank holds (gather: in, scatter: out), `whole`
 * the root's. */
static gs_status_t rooted(gs_comm_t c, const gs_tensor_t *mine, const gs_tensor_t *whole, int64_t n,
                          const int64_t *counts, int root, int gather) {
  rooted_t r = {gather, 1, NULL};
  gs_coll_t d = {.fn = gather ? "gs_gatherv" : "gs_scatterv",
                 .name = gather ? "gather" : "scatter",
                 .kind = gather ? GS_CALL_GATHERV : GS_CALL_SCATTERV,
                 .in = mine,
                 .out = whole,
                 .n = n,
                 .op = GS_OP_SUM,
                 .root = root,
                 .counts = counts,
                 .extra = &r,
                 .own_checks = 1,
                 .check = rooted_check,
                 .run = rooted_run,
                 .release = rooted_release};
  return gs_collective(c, &d);
}

gs_status_t gs_gatherv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                       const int64_t *counts, int root) {
  return rooted(c, in, out, n, counts, root, 1);
}

gs_status_t gs_scatterv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                        const int64_t *counts, int root) {
  return rooted(c, out, in, n, counts, root, 0);
}
