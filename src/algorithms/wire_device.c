/* The allreduce in a low-precision wire format on CUDA memory: the host
 * algorithm of transport/mpi/wire.c (a direct exchange of encoded shards,
 * float32 sums in rank order at each shard's owner, an allgather of the
 * rounded shards) with the encoding fused into the pack and the decoding
 * into the unpack: three kernels per segment read the tensors where they
 * are and write them back, and nothing in float32 travels or is staged.
 * Both exchanges are alltoallvs of bytes, so on NCCL each is one group of
 * ncclSend/ncclRecv (never an NCCL reduction in the low precision), and on
 * MPI the exchange collectives' device paths (CUDA-aware or staged).
 *
 * The segments, shards and blocks are the host's, and the kernels compute
 * with the host's arithmetic, so a device result has the host path's bits
 * for the same inputs (tests/gpu, tests/python/test_wire.py). */
#include <stdlib.h>

#include "algorithms/gs_algorithms.h"
#include "kernels/wire_format.h"

#define SEGMENT ((int64_t)GS_WIRE_BLOCK << 18) /* transport/mpi/wire.c's */
#define ALIGN 256

typedef struct dev_wire {
  const gs_engine_t *e;
  gs_cu_wire_job_t job;
  gs_cu_wire_run_t *runs; /* host; the passes upload them */
  int64_t *bytes, *displs, *rbytes, *rdispls, *mine; /* per rank */
  char *packed, *recv, *gathered;
} dev_wire_t;

/* The runs of message elements [at, at + n): each slot's part, empty ones
 * left out. */
static void segment_runs(dev_wire_t *w, const gs_plan_t *plan, const gs_message_t *m,
                         const gs_tensor_t *in, const gs_tensor_t *out, const gs_tensor_t *res,
                         int64_t at, int64_t n) {
  size_t es = gs_dtype_size(m->dtype);
  int64_t k = 0;
  for (int64_t i = m->first; i < m->first + m->nslots; i++) {
    const gs_slot_t *s = &plan->slots[i];
    int64_t lo = s->offset > at ? s->offset : at;
    int64_t hi = s->offset + s->count < at + n ? s->offset + s->count : at + n;
    if (lo >= hi) continue;
    int64_t skip = lo - s->offset;
    w->runs[k++] = (gs_cu_wire_run_t){.in = gs_at(in[s->tensor].data, (size_t)skip * es),
                                      .out = gs_at(out[s->tensor].data, (size_t)skip * es),
                                      .residual = res ? (float *)res[s->tensor].data + skip : NULL,
                                      .offset = lo - at,
                                      .count = hi - lo};
  }
  w->job.runs = w->runs;
  w->job.nruns = k;
  w->job.feedback = res != NULL;
  w->job.n = n;
}

/* The shards' bytes and places for a segment of n elements, and the two
 * exchanges' layouts. */
static void shard_layout(dev_wire_t *w, int64_t n) {
  int p = w->job.p, r = w->job.rank;
  int64_t at = 0, first, count;
  for (int q = 0; q < p; q++) {
    gs_wire_shard(n, p, q, &first, &count);
    w->bytes[q] = gs_wire_shard_bytes(w->job.wire, count);
    w->displs[q] = at;
    at += w->bytes[q];
  }
  for (int q = 0; q < p; q++) {
    w->rbytes[q] = w->bytes[r];
    w->rdispls[q] = q * w->bytes[r];
    w->mine[q] = w->displs[r];
  }
}

static gs_status_t exchange(dev_wire_t *w, const void *send, const int64_t *scounts,
                            const int64_t *sdispls, void *recv, const int64_t *rcounts,
                            const int64_t *rdispls) {
  gs_xfer_t x = {.dtype = GS_UINT8,
                 .send = send,
                 .recv = recv,
                 .scounts = scounts,
                 .sdispls = sdispls,
                 .rcounts = rcounts,
                 .rdispls = rdispls,
                 .native = 1}; /* a segment's bytes fit MPI's int */
  return gs_xfer_alltoallv(w->e, &x);
}

/* One segment: encode every shard, exchange, reduce this rank's, gather
 * the rounded shards, decode into the outputs. */
static gs_status_t segment(dev_wire_t *w) {
  const gs_engine_t *e = w->e;
  int p = w->job.p, r = w->job.rank;
  shard_layout(w, w->job.n);
  GS_CHECK(gs_cu_wire_pass(GS_CU_WIRE_ENCODE, w->job, NULL, w->packed, e->stream));
  int64_t total = w->displs[p - 1] + w->bytes[p - 1];
  gs_count_message(e->comm, total - w->bytes[r], GS_UINT8);
  GS_CHECK(exchange(w, w->packed, w->bytes, w->displs, w->recv, w->rbytes, w->rdispls));
  GS_CHECK(gs_cu_wire_pass(GS_CU_WIRE_REDUCE, w->job, w->recv, w->packed, e->stream));
  gs_count_message(e->comm, w->bytes[r] * (p - 1), GS_UINT8);
  GS_CHECK(exchange(w, w->packed, w->rbytes, w->mine, w->gathered, w->bytes, w->displs));
  return gs_cu_wire_pass(GS_CU_WIRE_DECODE, w->job, w->gathered, NULL, e->stream);
}

static size_t aligned(int64_t bytes) { return ((size_t)bytes + ALIGN - 1) / ALIGN * ALIGN; }

/* Device scratch for segments of up to `seg` elements: the packed shards,
 * p copies of this rank's, the gathered shards. */
static gs_status_t scratch(dev_wire_t *w, int64_t seg) {
  int64_t all = gs_wire_shard_bytes(w->job.wire, seg) + w->job.p;
  int64_t mine =
      gs_wire_shard_bytes(w->job.wire, (seg / GS_WIRE_BLOCK / w->job.p + 1) * GS_WIRE_BLOCK);
  size_t a = aligned(all), b = aligned(mine * w->job.p);
  void *buf;
  GS_CHECK(gs_scratch_reserve(w->e, 2 * a + b, &buf));
  w->packed = buf;
  w->recv = w->packed + a;
  w->gathered = w->recv + b;
  return GS_SUCCESS;
}

gs_status_t gs_wire_device_message(const gs_engine_t *e, const gs_plan_t *plan,
                                   const gs_message_t *m, const gs_tensor_t *in,
                                   const gs_tensor_t *out, const gs_tensor_t *residual,
                                   gs_wire_t wire, double pre, double post) {
  gs_comm_t c = e->comm;
  int p = c->size;
  dev_wire_t w = {.e = e,
                  .job = {.wire = (int32_t)wire,
                          .dtype = (int32_t)m->dtype,
                          .p = p,
                          .rank = c->rank,
                          .pre = (float)pre,
                          .post = (float)post}};
  int64_t seg = m->count < SEGMENT ? m->count : SEGMENT;
  w.runs = malloc((size_t)(m->nslots > 0 ? m->nslots : 1) * sizeof *w.runs);
  w.bytes = malloc(5 * (size_t)p * sizeof *w.bytes);
  gs_status_t s = w.runs && w.bytes ? scratch(&w, seg)
                                    : gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", e->call);
  if (s == GS_SUCCESS) {
    w.displs = w.bytes + p;
    w.rbytes = w.bytes + 2 * p;
    w.rdispls = w.bytes + 3 * p;
    w.mine = w.bytes + 4 * p;
  }
  for (int64_t at = 0; s == GS_SUCCESS && at < m->count; at += seg) {
    segment_runs(&w, plan, m, in, out, residual, at, m->count - at < seg ? m->count - at : seg);
    s = segment(&w);
  }
  free(w.runs);
  free(w.bytes);
  return s;
}
