/* The NCCL transport's data movement: gradsync's collectives as NCCL
 * calls on the communicator's stream, every call settled (polled, never
 * blocking: nccl.c). NCCL's min and max drop NaN (fmin/fmax); gradsync's
 * propagate it on every path, so float min/max go over NCCL as an integer
 * min/max of order keys (cuda_pieces.cuh) that keep NaN winning. */
#include <stdlib.h>

#ifdef GS_HAVE_NCCL
#include "transport/nccl/gs_nccl.h"

#define api gs_nccl_api

/* ---- the collectives ---------------------------------------------------------------------- */

static ncclDataType_t nccl_type(gs_dtype_t d) {
  switch (d) {
    case GS_FLOAT16: return ncclFloat16;
    case GS_BFLOAT16: return ncclBfloat16;
    case GS_FLOAT32: return ncclFloat32;
    case GS_FLOAT64: return ncclFloat64;
    case GS_INT8: return ncclInt8;
    case GS_UINT8: return ncclUint8;
    case GS_INT32: return ncclInt32;
    default: return ncclInt64;
  }
}

static ncclRedOp_t nccl_op(gs_op_t op) {
  switch (op) {
    case GS_OP_MIN: return ncclMin;
    case GS_OP_MAX: return ncclMax;
    case GS_OP_PROD: return ncclProd;
    default: return ncclSum; /* average: sum, scaled by the engine */
  }
}

#define COMM(c) ((ncclComm_t)(c)->nccl)
#define STREAM(c) ((cudaStream_t)(c)->dev_stream)

/* One rank reduces nothing: its data passes unchanged, as on every path. */
static int keyed(gs_comm_t c, gs_dtype_t dtype, gs_op_t op) {
  return c->size > 1 && (op == GS_OP_MIN || op == GS_OP_MAX) && gs_dtype_is_float(dtype);
}

static ncclDataType_t key_type(gs_dtype_t dtype) {
  return gs_cu_key_bytes(dtype) == 8 ? ncclUint64 : ncclUint32;
}

/* Scratch for keys: `elements` of them. */
static gs_status_t key_scratch(gs_comm_t c, int64_t elements, gs_dtype_t dtype, char **keys) {
  GS_CHECK(gs_cu_grow(&c->dev_keys, &c->dev_keys_bytes,
                      (size_t)elements * (size_t)gs_cu_key_bytes(dtype), c->dev_stream));
  *keys = c->dev_keys;
  return GS_SUCCESS;
}

static gs_status_t to_keys(gs_comm_t c, gs_dtype_t dtype, gs_op_t op, const void *src, void *keys,
                           int64_t n, int inverse) {
  return gs_cu_launched(
      gs_cu_launch_order_keys((int)dtype, op == GS_OP_MAX, inverse, src, keys, n, c->dev_stream),
      "gradsync: min/max order-key kernel launch");
}

static gs_status_t nccl_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                  gs_dtype_t dtype, gs_op_t op) {
  const void *src = send ? send : recv;
  if (!keyed(c, dtype, op)) {
    NCCL_CALL(c,
              api.ncclAllReduce(src, recv, (size_t)count, nccl_type(dtype), nccl_op(op), COMM(c),
                                STREAM(c)),
              "ncclAllReduce");
    return GS_SUCCESS;
  }
  char *keys = recv; /* 32- and 64-bit floats: keys of their own width, in place */
  if ((size_t)gs_cu_key_bytes(dtype) != gs_dtype_size(dtype))
    GS_CHECK(key_scratch(c, count, dtype, &keys));
  GS_CHECK(to_keys(c, dtype, op, src, keys, count, 0));
  NCCL_CALL(c,
            api.ncclAllReduce(keys, keys, (size_t)count, key_type(dtype), nccl_op(op), COMM(c),
                              STREAM(c)),
            "ncclAllReduce (min/max order keys)");
  return to_keys(c, dtype, op, keys, recv, count, 1);
}

static gs_status_t nccl_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                  int root) {
  NCCL_CALL(c,
            api.ncclBroadcast(buf, buf, (size_t)count, nccl_type(dtype), root, COMM(c), STREAM(c)),
            "ncclBroadcast");
  return GS_SUCCESS;
}

static int equal_blocks(gs_comm_t c, const int64_t *counts, const int64_t *displs) {
  for (int r = 0; r < c->size; r++)
    if (counts[r] != counts[0] || (displs && displs[r] != r * counts[0])) return 0;
  return 1;
}

/* Equal blocks: one ncclAllGather. Otherwise every rank broadcasts its
 * block, all in one group (NCCL runs them as one operation). */
static gs_status_t nccl_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                   const int64_t *displs, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  if (equal_blocks(c, counts, displs)) {
    char *mine = (char *)recv + (size_t)displs[c->rank] * es;
    NCCL_CALL(
        c, api.ncclAllGather(mine, recv, (size_t)counts[0], nccl_type(dtype), COMM(c), STREAM(c)),
        "ncclAllGather");
    return GS_SUCCESS;
  }
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int root = 0; root < c->size && (r == ncclSuccess || r == ncclInProgress); root++) {
    char *block = (char *)recv + (size_t)displs[root] * es;
    if (counts[root])
      r = api.ncclBroadcast(block, block, (size_t)counts[root], nccl_type(dtype), root, COMM(c),
                            STREAM(c));
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress)
    return gs_nccl_settle(c, r, "ncclBroadcast (allgatherv)");
  NCCL_CALL(c, g, "ncclGroupEnd (allgatherv)");
  return GS_SUCCESS;
}

/* Equal blocks: one ncclReduceScatter. Otherwise one ncclReduce per block,
 * rooted at its owner, in one group. Elements of `type`, `size` bytes each. */
static gs_status_t reduce_blocks(gs_comm_t c, const void *send, void *recv, const int64_t *counts,
                                 ncclDataType_t type, size_t size, ncclRedOp_t op) {
  if (equal_blocks(c, counts, NULL)) {
    NCCL_CALL(c, api.ncclReduceScatter(send, recv, (size_t)counts[0], type, op, COMM(c), STREAM(c)),
              "ncclReduceScatter");
    return GS_SUCCESS;
  }
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  size_t off = 0;
  for (int root = 0; root < c->size && (r == ncclSuccess || r == ncclInProgress); root++) {
    if (counts[root])
      r = api.ncclReduce((const char *)send + off, recv, (size_t)counts[root], type, op, root,
                         COMM(c), STREAM(c));
    off += (size_t)counts[root] * size;
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress)
    return gs_nccl_settle(c, r, "ncclReduce (reduce_scatter)");
  NCCL_CALL(c, g, "ncclGroupEnd (reduce_scatter)");
  return GS_SUCCESS;
}

static gs_status_t nccl_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                       const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  if (!keyed(c, dtype, op))
    return reduce_blocks(c, send, recv, counts, nccl_type(dtype), gs_dtype_size(dtype),
                         nccl_op(op));
  int64_t total = 0, mine = counts[c->rank];
  for (int r = 0; r < c->size; r++) total += counts[r];
  char *keys;
  size_t kb = (size_t)gs_cu_key_bytes(dtype);
  GS_CHECK(key_scratch(c, total + mine, dtype, &keys));
  GS_CHECK(to_keys(c, dtype, op, send, keys, total, 0));
  GS_CHECK(
      reduce_blocks(c, keys, keys + (size_t)total * kb, counts, key_type(dtype), kb, nccl_op(op)));
  return to_keys(c, dtype, op, keys + (size_t)total * kb, recv, mine, 1);
}

static gs_status_t nccl_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                 int64_t rcount, gs_dtype_t dtype, int peer) {
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  if (scount) r = api.ncclSend(sbuf, (size_t)scount, nccl_type(dtype), peer, COMM(c), STREAM(c));
  if ((r == ncclSuccess || r == ncclInProgress) && rcount)
    r = api.ncclRecv(rbuf, (size_t)rcount, nccl_type(dtype), peer, COMM(c), STREAM(c));
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return gs_nccl_settle(c, r, "ncclSend/ncclRecv");
  NCCL_CALL(c, g, "ncclGroupEnd (exchange)");
  return GS_SUCCESS;
}

/* One group for every peer: NCCL schedules the sends and receives
 * together, where pairwise groups would run one round after another. */
static gs_status_t nccl_alltoallv(gs_comm_t c, const void *send, const int64_t *scounts,
                                  const int64_t *sdispls, void *recv, const int64_t *rcounts,
                                  const int64_t *rdispls, gs_dtype_t dtype) {
  size_t es = gs_dtype_size(dtype);
  NCCL_CALL(c, api.ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int k = 1; k < c->size && (r == ncclSuccess || r == ncclInProgress); k++) {
    int to = (c->rank + k) % c->size, from = (c->rank - k + c->size) % c->size;
    if (scounts[to])
      r = api.ncclSend((const char *)send + (size_t)sdispls[to] * es, (size_t)scounts[to],
                       nccl_type(dtype), to, COMM(c), STREAM(c));
    if ((r == ncclSuccess || r == ncclInProgress) && rcounts[from])
      r = api.ncclRecv((char *)recv + (size_t)rdispls[from] * es, (size_t)rcounts[from],
                       nccl_type(dtype), from, COMM(c), STREAM(c));
  }
  ncclResult_t g = api.ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress)
    return gs_nccl_settle(c, r, "ncclSend/ncclRecv (alltoallv)");
  NCCL_CALL(c, g, "ncclGroupEnd (alltoallv)");
  return GS_SUCCESS;
}

const gs_transport_t gs_nccl_transport = {
    "nccl",         nccl_allreduce, nccl_broadcast,    nccl_allgatherv,   nccl_reduce_scatter,
    nccl_exchange,  gs_nccl_poll,   gs_nccl_abort,     gs_nccl_detail,    NULL,
    nccl_alltoallv, NULL,           gs_nccl_comm_init, gs_nccl_comm_free,
};

#endif
