/* Recursive doubling over point-to-point messages: the shape of MPI's own
 * small-message allreduce, built on waits gradsync controls, so it can time
 * out, be interrupted and let other threads in. Validation merges its
 * messages with it, small allreduces reduce with it, and Adasum folds its
 * extra ranks in and out with it (its tree as the core). */
#include "mpi/gs_mpi.h"

int gs_rd_core_size(int size) {
  int q = 1;
  while (q * 2 <= size) q *= 2;
  return q;
}

/* log2(q) levels: swap with rank ^ level, then combine lower into upper. */
static gs_status_t levels(const gs_rd_t *rd, int q, void *buf, void *other) {
  for (int level = 1; level < q; level <<= 1) {
    int partner = rd->rank ^ level;
    GS_CHECK(rd->swap(rd->ctx, buf, other, partner));
    if (rd->rank < partner) GS_CHECK(rd->combine(rd->ctx, buf, other, buf));
    else GS_CHECK(rd->combine(rd->ctx, other, buf, buf));
  }
  return GS_SUCCESS;
}

gs_status_t gs_rdouble(const gs_rd_t *rd, void *buf, void *other) {
  int p = rd->size, me = rd->rank, q = gs_rd_core_size(p);
  if (me >= q) { /* folded: hand the data over, get the result back */
    GS_CHECK(rd->swap(rd->ctx, buf, NULL, me - q));
    return rd->swap(rd->ctx, NULL, buf, me - q);
  }
  if (me < p - q) { /* fold rank me + q's data in: mine is the lower */
    GS_CHECK(rd->swap(rd->ctx, NULL, other, me + q));
    GS_CHECK(rd->combine(rd->ctx, buf, other, buf));
  }
  GS_CHECK(rd->core ? rd->core(rd->ctx, q) : levels(rd, q, buf, other));
  if (me < p - q) GS_CHECK(rd->swap(rd->ctx, buf, NULL, me + q));
  return GS_SUCCESS;
}
