/* Rooted collectives: gather and scatter with per-rank counts (each tensor
 * its own message), and reduce to a root (fused like allreduce, with the same
 * scaling arithmetic). Every rank passes the same counts; their hash per
 * tensor is part of the validated signature, so ranks that disagree about
 * any rank's count fail together before data moves, and all ranks can pick
 * the same MPI algorithm from counts they all hold. */
#include <stdlib.h>

#include "gs_internal.h"

/* Per tensor: a hash of its column of counts (the validated `extra`), and
 * whether every count and displacement fits one MPI call. */
static gs_status_t column_hashes(const char *fn, const int64_t *counts, int64_t n, int p,
                                 int64_t *hash, int *native) {
  int64_t limit = gs_env_mpi_max_count();
  *native = 1;
  for (int64_t i = 0; i < n; i++) {
    uint64_t h = 0x726f6f746564ull;
    int64_t sum = 0;
    for (int r = 0; r < p; r++) {
      int64_t v = counts[(size_t)r * n + i];
      if (v < 0 || v > INT64_MAX / 4 - sum)
        return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: counts[%lld] (tensor %lld, rank %d) is "
                       "invalid: %lld", fn, (long long)(r * n + i), (long long)i, r,
                       (long long)v);
      sum += v;
      h = gs_hash_mix(h, (uint64_t)v);
    }
    if (sum > limit) *native = 0;
    hash[i] = (int64_t)(h & 0x3fffffffffffffffull);
  }
  return GS_SUCCESS;
}

static gs_status_t check_root(const char *fn, gs_comm_t c, int root) {
  if (root < 0 || root >= c->size)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: root %d is not a rank of a communicator of "
                   "size %d", fn, root, c->size);
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
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: %s[%lld] has %lld elements; counts say %s "
                     "%lld", fn, name, (long long)i, (long long)t[i].count,
                     whole ? "all ranks' blocks add up to" : "this rank's block has",
                     (long long)want);
  }
  return GS_SUCCESS;
}

static gs_status_t check_pair_dtypes(const char *fn, const gs_tensor_t *in,
                                     const gs_tensor_t *out, int64_t n) {
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

static gs_status_t rooted_impl(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                               int64_t n, const int64_t *counts, int root, int gather) {
  const char *fn = gather ? "gs_gatherv" : "gs_scatterv";
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  int p = c->size, native = 1;
  const gs_tensor_t *mine = gather ? in : out, *whole = gather ? out : in;
  int64_t *hash = malloc((size_t)(n > 0 ? n : 1) * sizeof *hash);
  int64_t *v = malloc(2 * (size_t)p * sizeof *v);
  gs_status_t local = hash && v && n >= 0 ? GS_SUCCESS
                      : n < 0 ? gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: n is negative", fn)
                              : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  if (local == GS_SUCCESS)
    local = check_rooted(fn, c, mine, whole, n, counts, root, gather, hash, &native);
  gs_call_t call = {gather ? GS_CALL_GATHERV : GS_CALL_SCATTERV, GS_OP_SUM, root, n, mine,
                    hash, "per-rank counts (hash)", 1};
  if (local != GS_SUCCESS) { /* the arguments may not be readable */
    call.n = 0;
    call.tensors = NULL;
    call.extra = NULL;
  }
  gs_status_t s = gs_begin_call(c, &call, local);
  gs_engine_t e = {.device = -1};
  if (s == GS_SUCCESS && n > 0) s = gs_engine_open(c, mine, n, &e);
  e.call = gather ? "gather" : "scatter";
  for (int64_t i = 0; i < n && s == GS_SUCCESS; i++) {
    int me = c->rank == root;
    gs_xfer_t x = {mine[i].dtype, root, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, native};
    for (int r = 0; me && r < p; r++) {
      v[r] = counts[(size_t)r * n + i];
      v[p + r] = r ? v[p + r - 1] + v[r - 1] : 0;
    }
    if (gather) {
      x.send = in[i].data, x.scount = in[i].count;
      if (me) x.recv = out[i].data, x.rcounts = v, x.rdispls = v + p;
      s = gs_xfer_gatherv(&e, &x);
    } else {
      x.recv = out[i].data, x.rcount = out[i].count;
      if (me) x.send = in[i].data, x.scounts = v, x.sdispls = v + p;
      s = gs_xfer_scatterv(&e, &x);
    }
  }
  free(hash);
  free(v);
  return gs_engine_close(&e, s);
}

gs_status_t gs_gatherv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                       const int64_t *counts, int root) {
  gs_enter_runtime();
  gs_status_t s = rooted_impl(c, in, out, n, counts, root, 1);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_scatterv(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                        const int64_t *counts, int root) {
  gs_enter_runtime();
  gs_status_t s = rooted_impl(c, in, out, n, counts, root, 0);
  gs_leave_runtime();
  return s;
}
