/* Ring allreduce over a fused message whose tensors are scattered in memory.
 *
 * Packing a large message into the fusion buffer and back costs two extra
 * passes over the data, as much as the reduction itself on a shared-memory
 * node. Instead this sends and receives straight from the tensors: each piece
 * list becomes an MPI hindexed datatype, so MPI's own copy into its transport
 * is the pack. Reduce-scatter then allgather around the ring: every chunk is
 * reduced by one owner in a fixed order and copied to the others, so all
 * ranks hold the same bits, run after run. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

#define RING_TAG 0x6773
#define SEGMENT_BYTES ((int64_t)4 << 20) /* temp space, and one Sendrecv's worth */

typedef struct piece {
  char *addr;
  int64_t count;
} piece_t;

typedef struct ring {
  gs_comm_t c;
  const gs_plan_t *plan;
  const gs_message_t *m;
  const gs_tensor_t *t; /* where the message lives (in place) */
  size_t es;
  MPI_Datatype base;
  piece_t *pieces; /* scratch: at most nslots + 1 */
} ring_t;

/* The pieces of message elements [a, b) in the tensors' memory. */
static int64_t pieces_of(const ring_t *r, int64_t a, int64_t b) {
  int64_t np = 0;
  for (int64_t k = r->m->first; k < r->m->first + r->m->nslots; k++) {
    const gs_slot_t *s = &r->plan->slots[k];
    int64_t lo = s->offset > a ? s->offset : a;
    int64_t hi = s->offset + s->count < b ? s->offset + s->count : b;
    if (hi <= lo) continue;
    r->pieces[np].addr = (char *)r->t[s->tensor].data + (size_t)(lo - s->offset) * r->es;
    r->pieces[np].count = hi - lo;
    np++;
  }
  return np;
}

/* A datatype addressing the pieces absolutely (use with MPI_BOTTOM). Pieces
 * are at most SEGMENT_BYTES long, so every length fits an int. */
static gs_status_t pieces_type(const ring_t *r, int64_t np, MPI_Datatype *out) {
  int *lens = malloc((size_t)np * sizeof *lens);
  MPI_Aint *disps = malloc((size_t)np * sizeof *disps);
  if (!lens || !disps) {
    free(lens);
    free(disps);
    return gs_fail(GS_ERR_NO_MEMORY, "ring allreduce: out of memory");
  }
  gs_status_t s = GS_SUCCESS;
  for (int64_t i = 0; i < np; i++) {
    lens[i] = (int)r->pieces[i].count;
    MPI_Get_address(r->pieces[i].addr, &disps[i]);
  }
  int e = MPI_Type_create_hindexed((int)np, lens, disps, r->base, out);
  if (e == MPI_SUCCESS) e = MPI_Type_commit(out);
  if (e != MPI_SUCCESS) s = gs_mpi_fail(e, "ring allreduce: building a datatype");
  free(lens);
  free(disps);
  return s;
}

/* Balanced chunk c of P over the message. */
static void chunk(int64_t count, int p, int c, int64_t *a, int64_t *b) {
  int64_t q = count / p, rem = count % p;
  *a = c * q + (c < rem ? c : rem);
  *b = *a + q + (c < rem);
}

/* Sends message elements [sa, sa+n) to `right` and receives [ra, ra+n') from
 * `left`: into `tmp` when tmp != NULL (to be reduced), else into place. */
static gs_status_t exchange(ring_t *r, int64_t sa, int64_t sb, int64_t ra, int64_t rb,
                            void *tmp, int right, int left) {
  MPI_Datatype stype = MPI_DATATYPE_NULL, rtype = MPI_DATATYPE_NULL;
  void *sbuf = MPI_BOTTOM, *rbuf = MPI_BOTTOM;
  int scount = 1, rcount = 1;
  gs_status_t s = GS_SUCCESS;
  int64_t np = pieces_of(r, sa, sb);
  if (np == 1) { sbuf = r->pieces[0].addr; scount = (int)(sb - sa); stype = r->base; }
  else if (np == 0) { scount = 0; stype = r->base; }
  else s = pieces_type(r, np, &stype);
  if (s == GS_SUCCESS) {
    if (tmp) { rbuf = tmp; rcount = (int)(rb - ra); rtype = r->base; }
    else {
      np = pieces_of(r, ra, rb);
      if (np == 1) { rbuf = r->pieces[0].addr; rcount = (int)(rb - ra); rtype = r->base; }
      else if (np == 0) { rcount = 0; rtype = r->base; }
      else s = pieces_type(r, np, &rtype);
    }
  }
  if (s == GS_SUCCESS) {
    int e = MPI_Sendrecv(sbuf, scount, stype, right, RING_TAG, rbuf, rcount, rtype, left,
                         RING_TAG, r->c->mpi, MPI_STATUS_IGNORE);
    if (e != MPI_SUCCESS) s = gs_mpi_fail(e, "ring allreduce: MPI_Sendrecv");
  }
  if (stype != r->base && stype != MPI_DATATYPE_NULL) MPI_Type_free(&stype);
  if (rtype != r->base && rtype != MPI_DATATYPE_NULL) MPI_Type_free(&rtype);
  return s;
}

/* Folds tmp (elements [a, b) from the left neighbour) into the pieces. */
static void reduce_into(ring_t *r, gs_op_t op, const char *tmp, int64_t a, int64_t b) {
  int64_t np = pieces_of(r, a, b);
  for (int64_t i = 0; i < np; i++) {
    gs_cpu_reduce(r->m->dtype, op, tmp, r->pieces[i].addr, r->pieces[i].count);
    tmp += (size_t)r->pieces[i].count * r->es;
  }
}

gs_status_t gs_ring_allreduce(gs_comm_t c, const gs_plan_t *plan, const gs_message_t *m,
                              const gs_tensor_t *t, gs_op_t op, double post) {
  ring_t r = {c, plan, m, t, gs_dtype_size(m->dtype), MPI_DATATYPE_NULL, NULL};
  GS_CHECK(gs_mpi_datatype(m->dtype, &r.base));
  int p = c->size, me = c->rank, right = (me + 1) % p, left = (me + p - 1) % p;
  int64_t seg = SEGMENT_BYTES / (int64_t)r.es;
  void *tmp = NULL;
  GS_CHECK(gs_fusion_reserve(c, (size_t)SEGMENT_BYTES, &tmp));
  r.pieces = malloc((size_t)(m->nslots + 1) * sizeof *r.pieces);
  if (!r.pieces) return gs_fail(GS_ERR_NO_MEMORY, "ring allreduce: out of memory");
  c->stats.messages++;
  c->stats.bytes += (uint64_t)m->count * r.es;
  gs_status_t s = GS_SUCCESS;

  /* Reduce-scatter: after step k this rank holds chunk (me - k - 1) summed
   * over k + 2 ranks; after p - 1 steps it owns chunk (me + 1) % p. */
  for (int k = 0; k < p - 1 && s == GS_SUCCESS; k++) {
    int64_t sa, sb, ra, rb;
    chunk(m->count, p, (me - k + p) % p, &sa, &sb);
    chunk(m->count, p, (me - k - 1 + 2 * p) % p, &ra, &rb);
    /* Chunks differ by at most one element: walk both in step. */
    for (int64_t off = 0; s == GS_SUCCESS && (sa + off < sb || ra + off < rb); off += seg) {
      int64_t s0 = sa + off < sb ? sa + off : sb, s1 = s0 + seg < sb ? s0 + seg : sb;
      int64_t r0 = ra + off < rb ? ra + off : rb, r1 = r0 + seg < rb ? r0 + seg : rb;
      s = exchange(&r, s0, s1, r0, r1, tmp, right, left);
      if (s == GS_SUCCESS) reduce_into(&r, op, tmp, r0, r1);
    }
  }
  int64_t oa, ob;
  chunk(m->count, p, (me + 1) % p, &oa, &ob);
  if (s == GS_SUCCESS && post != 1.0) {
    int64_t np = pieces_of(&r, oa, ob);
    for (int64_t i = 0; i < np; i++)
      gs_cpu_scale_copy(m->dtype, r.pieces[i].addr, r.pieces[i].addr, r.pieces[i].count, post);
  }
  /* Allgather: pass owned chunks around the ring, straight into place. */
  for (int k = 0; k < p - 1 && s == GS_SUCCESS; k++) {
    int64_t sa, sb, ra, rb;
    chunk(m->count, p, (me + 1 - k + p) % p, &sa, &sb);
    chunk(m->count, p, (me - k + p) % p, &ra, &rb);
    for (int64_t off = 0; s == GS_SUCCESS && (sa + off < sb || ra + off < rb); off += seg) {
      int64_t s0 = sa + off < sb ? sa + off : sb, s1 = s0 + seg < sb ? s0 + seg : sb;
      int64_t r0 = ra + off < rb ? ra + off : rb, r1 = r0 + seg < rb ? r0 + seg : rb;
      s = exchange(&r, s0, s1, r0, r1, NULL, right, left);
    }
  }
  free(r.pieces);
  return s;
}
