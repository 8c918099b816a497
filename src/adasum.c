/* Adasum by vector-halving distance-doubling (DESIGN section 4).
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

#include "gs_cuda.h"
#include "gs_internal.h"

#define ADASUM_TAG 0x6164
#define SQRT_DBL_MIN 1.4916681462400413e-154 /* sqrt(DBL_MIN) */
#define CHUNK ((int64_t)1 << 30)

/* Sends scount elements and receives rcount from `peer`, in chunks MPI's
 * int counts can carry; either side may be empty. */
static gs_status_t host_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                 int64_t rcount, gs_dtype_t dtype, int peer) {
  MPI_Datatype dt;
  GS_CHECK(gs_mpi_datatype(dtype, &dt));
  size_t es = gs_dtype_size(dtype);
  for (int64_t off = 0; off < scount || off < rcount; off += CHUNK) {
    int sn = (int)(scount - off < CHUNK ? (scount > off ? scount - off : 0) : CHUNK);
    int rn = (int)(rcount - off < CHUNK ? (rcount > off ? rcount - off : 0) : CHUNK);
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (rn) GS_MPI_CHECK(MPI_Irecv((char *)rbuf + (size_t)off * es, rn, dt, peer, ADASUM_TAG,
                                   c->mpi, &req[0]), "adasum: MPI_Irecv");
    if (sn) GS_MPI_CHECK(MPI_Isend((const char *)sbuf + (size_t)off * es, sn, dt, peer,
                                   ADASUM_TAG, c->mpi, &req[1]), "adasum: MPI_Isend");
    for (int k = 0; k < 2; k++)
      if (req[k] != MPI_REQUEST_NULL) GS_CHECK(gs_mpi_wait(&req[k], "adasum exchange", NULL, NULL));
  }
  return GS_SUCCESS;
}

/* The exchange in the engine's memory: NCCL send/recv on the device, or
 * MPI through pinned host memory. */
static gs_status_t exchange(const gs_engine_t *e, const void *sbuf, int64_t scount, void *rbuf,
                            int64_t rcount, gs_dtype_t dtype, int peer) {
  gs_comm_t c = e->comm;
  if (!gs_engine_on_device(e)) return host_exchange(c, sbuf, scount, rbuf, rcount, dtype, peer);
  if (c->dev_path == GS_PATH_NCCL)
    return gs_nccl_exchange(c, sbuf, scount, rbuf, rcount, dtype, peer);
  if (c->dev_path == GS_PATH_CUDA_AWARE) { /* MPI reads and writes device memory */
    GS_CHECK(gs_cu_stream_wait(c->dev_stream, "adasum: before CUDA-aware MPI"));
    return host_exchange(c, sbuf, scount, rbuf, rcount, dtype, peer);
  }
  return gs_staged_exchange(c, sbuf, scount, rbuf, rcount, dtype, peer, host_exchange);
}

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
  free(c->adasum_tmp);
  c->adasum_levels = NULL;
  c->adasum_nlevels = 0;
  c->adasum_tmp = NULL;
  c->adasum_tmp_bytes = 0;
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
static gs_status_t partial_dots(const gs_engine_t *e, const gs_plan_t *plan,
                                const gs_message_t *m, int64_t lo, int64_t hi, const char *left,
                                const char *right, double *d, int64_t *work) {
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
                           int64_t lo, int64_t hi, const double *d, double plain,
                           const char *left, const char *right, char *out, int64_t *work) {
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
  int g = gs_env_hierarchy_size(), from_env = g > 0;
  if (!from_env) g = c->local_size;
  *size = 1;
  if (g & (g - 1))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: hierarchical adasum needs a power-of-two "
                   "number of ranks per %s; it is %d", fn, from_env ? "group" : "node", g);
  if (c->size % g != 0 || ((c->size / g) & (c->size / g - 1)))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: hierarchical adasum needs a power-of-two "
                   "number of equal %s; %d ranks do not make one with %d ranks each", fn,
                   from_env ? "groups" : "nodes", c->size, g);
  if (!from_env && c->local_rank != c->rank % g)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: hierarchical adasum needs each node's ranks "
                   "to be consecutive (rank %d is local rank %d of %d); place ranks by node, "
                   "or set GRADSYNC_HIERARCHY_SIZE", fn, c->rank, c->local_rank, g);
  *size = g;
  return GS_SUCCESS;
}

gs_status_t gs_adasum_message(const gs_engine_t *e, const gs_plan_t *plan,
                              const gs_message_t *m, void *xv, int sum_levels) {
  gs_comm_t c = e->comm;
  int p = c->size, me = c->rank, q = 1, nlevels = 0;
  if (p == 1 || m->count == 0) return GS_SUCCESS;
  while (q * 2 <= p) { q *= 2; nlevels++; }
  char *x = xv, *tmp = NULL;
  size_t es = gs_dtype_size(m->dtype);
  int64_t n = m->count;
  GS_CHECK(level_comms(c, q, nlevels));
  GS_CHECK(gs_scratch_reserve(e, (size_t)n * es, (void **)&tmp));
  double *d = malloc(3 * (size_t)m->nslots * sizeof *d + 1);
  int64_t *work = malloc(3 * (size_t)m->nslots * sizeof *work + 1);
  int64_t (*ranges)[2] = malloc((size_t)(nlevels + 1) * sizeof *ranges);
  if (!d || !ranges || !work) {
    free(d);
    free(work);
    free(ranges);
    return gs_fail(GS_ERR_NO_MEMORY, "adasum: out of memory");
  }
  c->stats.messages++;
  c->stats.bytes += (uint64_t)n * es;
  gs_status_t s = GS_SUCCESS;

  /* Fold ranks Q..P-1 into 0..P-Q-1: h_i = adasum(g_i, g_{Q+i}). */
  if (me >= q) {
    s = exchange(e, x, n, NULL, 0, m->dtype, me - q);
  } else if (me < p - q) {
    s = exchange(e, NULL, 0, tmp, n, m->dtype, me + q);
    if (s == GS_SUCCESS) s = partial_dots(e, plan, m, 0, n, x, tmp, d, work);
    if (s == GS_SUCCESS) s = combine(e, plan, m, 0, n, d, 1.0, x, tmp, x, work);
  }

  static const char *const level_names[] = {
      "adasum level 0",  "adasum level 1",  "adasum level 2",  "adasum level 3",
      "adasum level 4",  "adasum level 5",  "adasum level 6",  "adasum level 7",
      "adasum level 8",  "adasum level 9",  "adasum level 10", "adasum level 11",
      "adasum level 12", "adasum level 13", "adasum level 14", "adasum level 15+"};
  int64_t row = 1 + (m - plan->msgs);
  if (me < q) {
    int64_t lo = 0, hi = n;
    for (int k = 0; k < nlevels && s == GS_SUCCESS; k++) {
      double t0 = GS_TL_START();
      int partner = me ^ (1 << k), lower = me < partner;
      int64_t mid = lo + (hi - lo) / 2;
      int64_t klo = lower ? lo : mid, khi = lower ? mid : hi; /* kept */
      int64_t glo = lower ? mid : lo, ghi = lower ? hi : mid; /* given */
      ranges[k][0] = lo;
      ranges[k][1] = hi;
      s = exchange(e, x + (size_t)glo * es, ghi - glo, tmp, khi - klo, m->dtype, partner);
      if (s != GS_SUCCESS) break;
      char *mine = x + (size_t)klo * es;
      const char *left = lower ? mine : tmp, *right = lower ? tmp : mine;
      if (k < sum_levels) { /* inside a group: a sum, the last level makes it the mean */
        double plain = k == sum_levels - 1 ? 1.0 / (double)(1 << sum_levels) : 1.0;
        s = combine(e, plan, m, klo, khi, NULL, plain, left, right, mine, work);
        lo = klo;
        hi = khi;
        continue;
      }
      s = partial_dots(e, plan, m, klo, khi, left, right, d, work);
      if (s != GS_SUCCESS) break;
      MPI_Request req;
      int mpi_e = MPI_Iallreduce(MPI_IN_PLACE, d, (int)(3 * m->nslots), MPI_DOUBLE, MPI_SUM,
                                 c->adasum_levels[k], &req);
      s = mpi_e == MPI_SUCCESS ? gs_mpi_wait(&req, "adasum: level MPI_Iallreduce", NULL, NULL)
                               : gs_mpi_fail(mpi_e, "adasum: level MPI_Iallreduce");
      if (s != GS_SUCCESS) break;
      s = combine(e, plan, m, klo, khi, d, 1.0, left, right, mine, work);
      GS_TL_END(level_names[k < 15 ? k : 15], e->call, row, t0, (khi - klo) * (int64_t)es);
      lo = klo;
      hi = khi;
    }
    double tg = GS_TL_START();
    /* Mirror allgather: give back what each level took. */
    for (int k = nlevels - 1; k >= 0 && s == GS_SUCCESS; k--) {
      int partner = me ^ (1 << k);
      int64_t plo = ranges[k][0], phi = ranges[k][1];
      int64_t olo = lo == plo ? hi : plo, ohi = lo == plo ? phi : lo; /* partner's part */
      s = exchange(e, x + (size_t)lo * es, hi - lo, x + (size_t)olo * es, ohi - olo, m->dtype,
                   partner);
      lo = plo;
      hi = phi;
    }
    GS_TL_END("adasum allgather", e->call, row, tg, n * (int64_t)es);
  }

  /* Hand the result back to the folded ranks. */
  if (s == GS_SUCCESS) {
    if (me < p - q) s = exchange(e, x, n, NULL, 0, m->dtype, me + q);
    else if (me >= q) s = exchange(e, NULL, 0, x, n, m->dtype, me - q);
  }
  free(d);
  free(work);
  free(ranges);
  return s;
}
