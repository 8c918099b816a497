/* Adasum by vector-halving distance-doubling (docs/GUIDE.md, Adasum).
 *
 * Ranks 0..Q-1 (Q the largest power of two <= P) run the tree; ranks Q..P-1
 * first hand their gradients to rank i - Q, which folds them in, and get the
 * result back at the end. At level L a rank pairs with rank ^ L; the lower
 * keeps the first floor(count/2) elements of its current range. The two
 * sides' partial dot products, per tensor, are summed over the block of 2L
 * ranks that together hold the whole vector, so coefficients cover whole
 * tensors. Tensor boundaries come from the fusion plan's offset table.
 * Every element of the result is computed by exactly one rank and then
 * copied to the others, so all ranks hold the same bits. */
#include <stdlib.h>
#include <string.h>

#include "algorithms/gs_algorithms.h"

#define SQRT_DBL_MIN 1.4916681462400413e-154 /* sqrt(DBL_MIN) */

/* Level k's communicator groups blocks of 2^(k+1) ranks among 0..Q-1. Made
 * once per communicator (collectively, inside the first Adasum call). */
static gs_status_t level_comms(gs_comm_t c, int q, int nlevels) {
  if (c->adasum_levels || nlevels == 0) return GS_SUCCESS;
  MPI_Comm *lv = calloc((size_t)nlevels, sizeof *lv);
  if (!lv) return gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  for (int k = 0; k < nlevels; k++) {
    int color = c->rank < q ? c->rank >> (k + 1) : MPI_UNDEFINED;
    int e = MPI_Comm_split(c->mpi, color, c->rank, &lv[k]);
    if (e != MPI_SUCCESS) {
      for (int j = 0; j < k; j++)
        if (lv[j] != MPI_COMM_NULL) MPI_Comm_free(&lv[j]);
      free(lv);
      return gs_mpi_fail(e, "adasum: MPI_Comm_split");
    }
  }
  c->adasum_levels = lv;
  c->adasum_nlevels = nlevels;
  return GS_SUCCESS;
}

void gs_adasum_free(gs_comm_t c) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  for (int k = 0; k < c->adasum_nlevels && init && !fin; k++)
    if (c->adasum_levels[k] != MPI_COMM_NULL) MPI_Comm_free(&c->adasum_levels[k]);
  free(c->adasum_levels);
  c->adasum_levels = NULL;
  c->adasum_nlevels = 0;
}

/* The slots' parts inside [lo, hi), as (start relative to lo, count) pairs
 * and the slot each belongs to; returns how many. */
static int64_t slot_parts(const gs_plan_t *plan, const gs_message_t *m, int64_t lo, int64_t hi,
                          int64_t *start, int64_t *count, int64_t *slot) {
  int64_t np = 0;
  for (int64_t j = 0; j < m->nslots; j++) {
    const gs_slot_t *s = &plan->slots[m->first + j];
    int64_t a = s->offset > lo ? s->offset : lo;
    int64_t b = s->offset + s->count < hi ? s->offset + s->count : hi;
    if (b <= a) continue;
    start[np] = a - lo;
    count[np] = b - a;
    slot[np] = j;
    np++;
  }
  return np;
}

/* d[3j..3j+2] = <left,right>, <left,left>, <right,right> of slot j's part
 * inside [lo, hi); left/right hold elements lo..hi-1. `work` has 3 * nslots
 * int64 of room. */
static gs_status_t partial_dots(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                                int64_t lo, int64_t hi, const char *left, const char *right,
                                double *d, int64_t *work) {
  size_t es = gs_dtype_size(m->dtype);
  memset(d, 0, 3 * (size_t)m->nslots * sizeof *d);
  int64_t *start = work, *count = work + m->nslots, *slot = work + 2 * m->nslots;
  int64_t np = slot_parts(plan, m, lo, hi, start, count, slot);
  if (!gs_engine_on_device(e)) {
    for (int64_t k = 0; k < np; k++)
      gs_cpu_adasum_dots(m->dtype, left + (size_t)start[k] * es, right + (size_t)start[k] * es,
                         count[k], &d[3 * slot[k]]);
    return GS_SUCCESS;
  }
  /* parts are in slot order; scatter their dots to their slots afterwards */
  double *pd = malloc(3 * (size_t)(np ? np : 1) * sizeof *pd);
  if (!pd) return gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  gs_status_t s = gs_cu_adasum_dots(m->dtype, left, right, start, count, np, pd, e->stream);
  for (int64_t k = 0; s == GS_SUCCESS && k < np; k++)
    for (int q = 0; q < 3; q++) d[3 * slot[k] + q] = pd[3 * k + q];
  free(pd);
  return s;
}

/* out = ca*left + cb*right per slot, with the pair formula's coefficients;
 * d == NULL: ca = cb = plain (hierarchical mode's sums inside a group). */
static gs_status_t combine(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                           int64_t lo, int64_t hi, const double *d, double plain, const char *left,
                           const char *right, char *out, int64_t *work) {
  size_t es = gs_dtype_size(m->dtype);
  int64_t *start = work, *count = work + m->nslots, *slot = work + 2 * m->nslots;
  int64_t np = slot_parts(plan, m, lo, hi, start, count, slot);
  double *coef = malloc(2 * (size_t)(np ? np : 1) * sizeof *coef);
  if (!coef) return gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  for (int64_t k = 0; k < np && !d; k++) coef[2 * k] = coef[2 * k + 1] = plain;
  for (int64_t k = 0; k < np && d; k++) {
    const double *dj = &d[3 * slot[k]];
    double dot = dj[0], na = dj[1], nb = dj[2];
    coef[2 * k] = na >= SQRT_DBL_MIN ? 1.0 - dot / (2.0 * na) : 1.0;
    coef[2 * k + 1] = nb >= SQRT_DBL_MIN ? 1.0 - dot / (2.0 * nb) : 1.0;
  }
  gs_status_t s = GS_SUCCESS;
  if (gs_engine_on_device(e)) {
    s = gs_cu_adasum_combine(m->dtype, left, right, out, start, count, coef, np, e->stream);
  } else {
    for (int64_t k = 0; k < np; k++) {
      size_t o = (size_t)start[k] * es;
      gs_cpu_adasum_combine(m->dtype, coef[2 * k], left + o, coef[2 * k + 1], right + o, out + o,
                            count[k]);
    }
  }
  free(coef);
  return s;
}

gs_status_t gs_adasum_group_size(gs_comm_t c, const char *fn, int *size) {
  /* the hosts' sizes and placement were agreed by all ranks when the
   * communicator was made, so every rank reaches the same verdict */
  int g = gs_env_hierarchy_size(), from_env = g > 0;
  *size = 1;
  if (!from_env && c->host_min != c->host_max)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: hierarchical adasum needs the same number of "
                   "ranks on every node; the nodes hold %d to %d ranks",
                   fn, c->host_min, c->host_max);
  if (!from_env) g = c->local_size;
  if (g & (g - 1))
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: hierarchical adasum needs a power-of-two "
                   "number of ranks per %s; it is %d",
                   fn, from_env ? "group" : "node", g);
  if (c->size % g != 0 || ((c->size / g) & (c->size / g - 1)))
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: hierarchical adasum needs a power-of-two "
                   "number of equal %s; %d ranks do not make one with %d ranks each",
                   fn, from_env ? "groups" : "nodes", c->size, g);
  if (!from_env && !c->hosts_consecutive)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: hierarchical adasum needs each node's ranks "
                   "to be consecutive ranks, and some node's are not; place ranks by node "
                   "(blocks of %d), or set GRADSYNC_HIERARCHY_SIZE",
                   fn, g);
  *size = g;
  return GS_SUCCESS;
}

/* One message's Adasum: what every step needs. */
typedef struct adasum_run {
  const gs_engine_t *e;
  const gs_plan_t *plan;
  const gs_message_t *m;
  char *x, *tmp;        /* the message; received halves */
  size_t es;
  int sum_levels;       /* hierarchical: levels inside a group only sum */
  double *d;            /* 3 dot products per slot */
  int64_t *work;        /* 3 * nslots: slot parts */
  int64_t (*ranges)[2]; /* the range each level started from */
} adasum_run_t;

/* The fold's messages: the whole message one way (rdouble.c). */
static gs_status_t fold_swap(void *ctx, const void *send, void *recv, int peer) {
  adasum_run_t *a = ctx;
  int64_t n = a->m->count;
  return a->e->transport->exchange(a->e->comm, send, send ? n : 0, recv, recv ? n : 0, a->m->dtype,
                                   peer);
}

/* A folded rank's gradients into its partner's: h = adasum(lower, upper). */
static gs_status_t fold_combine(void *ctx, const void *lower, const void *upper, void *out) {
  adasum_run_t *a = ctx;
  int64_t n = a->m->count;
  GS_CHECK(partial_dots(a->e, a->plan, a->m, 0, n, lower, upper, a->d, a->work));
  return combine(a->e, a->plan, a->m, 0, n, a->d, 1.0, lower, upper, out, a->work);
}

static const char *const level_names[] = {
    "adasum level 0",  "adasum level 1",  "adasum level 2",  "adasum level 3",
    "adasum level 4",  "adasum level 5",  "adasum level 6",  "adasum level 7",
    "adasum level 8",  "adasum level 9",  "adasum level 10", "adasum level 11",
    "adasum level 12", "adasum level 13", "adasum level 14", "adasum level 15+"};

/* Level k of the halving: keep half of [*lo, *hi), combine it with the
 * partner's copy of that half (the dot products summed over the block of
 * 2^(k+1) ranks that holds the whole vector). */
static gs_status_t halve(adasum_run_t *a, int k, int64_t *lo, int64_t *hi) {
  gs_comm_t c = a->e->comm;
  int me = c->rank, partner = me ^ (1 << k), lower = me < partner;
  int64_t mid = *lo + (*hi - *lo) / 2;
  int64_t klo = lower ? *lo : mid, khi = lower ? mid : *hi; /* kept */
  int64_t glo = lower ? mid : *lo, ghi = lower ? *hi : mid; /* given */
  a->ranges[k][0] = *lo;
  a->ranges[k][1] = *hi;
  GS_CHECK(a->e->transport->exchange(c, a->x + (size_t)glo * a->es, ghi - glo, a->tmp, khi - klo,
                                     a->m->dtype, partner));
  char *mine = a->x + (size_t)klo * a->es;
  const char *left = lower ? mine : a->tmp, *right = lower ? a->tmp : mine;
  *lo = klo;
  *hi = khi;
  if (k < a->sum_levels) { /* inside a group: a sum, the last level makes it the mean */
    double plain = k == a->sum_levels - 1 ? 1.0 / (double)(1 << a->sum_levels) : 1.0;
    return combine(a->e, a->plan, a->m, klo, khi, NULL, plain, left, right, mine, a->work);
  }
  GS_CHECK(partial_dots(a->e, a->plan, a->m, klo, khi, left, right, a->d, a->work));
  MPI_Request req;
  int mpi_e = MPI_Iallreduce(MPI_IN_PLACE, a->d, (int)(3 * a->m->nslots), MPI_DOUBLE, MPI_SUM,
                             c->adasum_levels[k], &req);
  GS_CHECK(mpi_e == MPI_SUCCESS ? gs_mpi_wait(&req, "adasum: level MPI_Iallreduce", NULL, NULL)
                                : gs_mpi_fail(mpi_e, "adasum: level MPI_Iallreduce"));
  return combine(a->e, a->plan, a->m, klo, khi, a->d, 1.0, left, right, mine, a->work);
}

/* The tree over ranks 0..q-1: halving levels, then the mirror allgather
 * giving back what each level took. */
static gs_status_t tree(void *ctx, int q) {
  adasum_run_t *a = ctx;
  int me = a->e->comm->rank, nlevels = 0;
  while ((1 << nlevels) < q) nlevels++;
  int64_t lo = 0, hi = a->m->count, row = 1 + (a->m - a->plan->msgs);
  for (int k = 0; k < nlevels; k++) {
    double t0 = GS_TL_START();
    GS_CHECK(halve(a, k, &lo, &hi));
    GS_TL_END(level_names[k < 15 ? k : 15], a->e->call, row, t0, (hi - lo) * (int64_t)a->es);
  }
  double tg = GS_TL_START();
  for (int k = nlevels - 1; k >= 0; k--) {
    int64_t plo = a->ranges[k][0], phi = a->ranges[k][1];
    int64_t olo = lo == plo ? hi : plo, ohi = lo == plo ? phi : lo; /* partner's part */
    GS_CHECK(a->e->transport->exchange(a->e->comm, a->x + (size_t)lo * a->es, hi - lo,
                                       a->x + (size_t)olo * a->es, ohi - olo, a->m->dtype,
                                       me ^ (1 << k)));
    lo = plo;
    hi = phi;
  }
  GS_TL_END("adasum allgather", a->e->call, row, tg, a->m->count * (int64_t)a->es);
  return GS_SUCCESS;
}

gs_status_t gs_adasum_message(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                              void *x, int sum_levels) {
  gs_comm_t c = e->comm;
  if (c->size == 1 || m->count == 0) return GS_SUCCESS;
  int q = gs_rd_core_size(c->size), nlevels = 0;
  while ((1 << nlevels) < q) nlevels++;
  adasum_run_t a = {e, plan, m, x, NULL, gs_dtype_size(m->dtype), sum_levels, NULL, NULL, NULL};
  GS_CHECK(level_comms(c, q, nlevels));
  GS_CHECK(gs_scratch_reserve(e, (size_t)m->count * a.es, (void **)&a.tmp));
  a.d = malloc(3 * (size_t)m->nslots * sizeof *a.d + 1);
  a.work = malloc(3 * (size_t)m->nslots * sizeof *a.work + 1);
  a.ranges = malloc((size_t)(nlevels + 1) * sizeof *a.ranges);
  gs_status_t s = GS_SUCCESS;
  if (!a.d || !a.ranges || !a.work) s = gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  gs_count_message(c, m->count, m->dtype);
  gs_rd_t rd = {c->rank, c->size, fold_swap, fold_combine, tree, &a};
  if (s == GS_SUCCESS) s = gs_rdouble(&rd, x, a.tmp);
  free(a.d);
  free(a.work);
  free(a.ranges);
  return s;
}
