/* The asynchronous collectives: each copies its arguments (descriptors and
 * count arrays) and queues a job (queue.c) that calls the blocking entry
 * point on the background thread, in issue order with the other
 * asynchronous collectives. Argument errors surface at wait, on every rank,
 * as the blocking call reports them. */
#include <stdlib.h>
#include <string.h>

#include "coll/gs_collective.h"

typedef enum {
  CALL_ALLREDUCE,
  CALL_ALLREDUCE_WIRE, /* out: the residuals, or NULL */
  CALL_BROADCAST,
  CALL_AG_SHARDS,
  CALL_RS_SHARDS,
  CALL_ALLGATHERV,
  CALL_REDUCE_SCATTER,
  CALL_ALLTOALLV,
  CALL_GATHERV,
  CALL_SCATTERV,
  CALL_REDUCE
} call_t;

typedef struct call_ctx {
  call_t kind;
  gs_comm_t comm;
  gs_tensor_t *in, *out;
  int64_t n;
  int64_t *a, *b; /* count arrays, or NULL */
  gs_op_t op;
  double pre, post;
  int root;
  gs_wire_t wire;
  gs_call_options_t options; /* the caller's when it queued the call */
} call_ctx_t;

static void release(void *ctx) {
  call_ctx_t *x = ctx;
  free(x->in);
  free(x->out);
  free(x->a);
  free(x->b);
  free(x);
}

static gs_status_t dispatch(const call_ctx_t *x) {
  switch (x->kind) {
    case CALL_ALLREDUCE: return gs_allreduce(x->comm, x->in, NULL, x->n, x->op, x->pre, x->post);
    case CALL_ALLREDUCE_WIRE:
      return gs_allreduce_wire(x->comm, x->in, NULL, x->n, x->op, x->pre, x->post, x->wire, x->out);
    case CALL_BROADCAST: return gs_broadcast(x->comm, x->in, x->n, x->root);
    case CALL_AG_SHARDS: return gs_allgather_shards(x->comm, x->in, x->n);
    case CALL_RS_SHARDS:
      return gs_reduce_scatter_shards(x->comm, x->in, x->n, x->op, x->pre, x->post);
    case CALL_ALLGATHERV: return gs_allgatherv(x->comm, x->in, x->out, x->n, x->a);
    case CALL_REDUCE_SCATTER:
      return gs_reduce_scatter(x->comm, x->in, x->out, x->n, x->a, x->op, x->pre, x->post);
    case CALL_ALLTOALLV: return gs_alltoallv(x->comm, x->in, x->out, x->n, x->a, x->b);
    case CALL_GATHERV: return gs_gatherv(x->comm, x->in, x->out, x->n, x->a, x->root);
    case CALL_SCATTERV: return gs_scatterv(x->comm, x->in, x->out, x->n, x->a, x->root);
    case CALL_REDUCE:
      return gs_reduce(x->comm, x->in, x->out, x->n, x->op, x->pre, x->post, x->root);
  }
  return gs_fail(GS_ERR_INTERNAL, "async: unknown call %d", (int)x->kind);
}

/* On the background thread, under the options the caller had. */
static gs_status_t run(void *ctx) {
  call_ctx_t *x = ctx;
  gs_call_options_t before = gs_runtime_swap_call_options(x->options);
  gs_status_t s = dispatch(x);
  gs_runtime_swap_call_options(before);
  return s;
}

/* A copy of `count` items of `size` bytes, or NULL for NULL (the blocking
 * call then reports the missing argument). */
static int dup_into(void **dst, const void *src, int64_t count, size_t size) {
  *dst = NULL;
  if (!src || count <= 0) return 1;
  *dst = malloc((size_t)count * size);
  if (*dst) memcpy(*dst, src, (size_t)count * size);
  return *dst != NULL;
}

/* `acount`/`bcount`: entries in the count arrays (0 when the call has none). */
static gs_status_t queue(const char *fn, call_ctx_t proto, const gs_tensor_t *in,
                         const gs_tensor_t *out, int64_t acount, const int64_t *a, const int64_t *b,
                         gs_request_t *request) {
  gs_clear_error();
  if (!request) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: request is NULL", fn);
  *request = NULL;
  GS_CHECK(gs_comm_valid(proto.comm, fn));
  if (proto.n < 0) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: n is negative", fn);
  call_ctx_t *x = calloc(1, sizeof *x);
  if (!x) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  *x = proto;
  gs_get_call_options(&x->options);
  x->in = x->out = NULL;
  x->a = x->b = NULL;
  int ok = dup_into((void **)&x->in, in, proto.n, sizeof *in) &&
           dup_into((void **)&x->out, out, proto.n, sizeof *out) &&
           dup_into((void **)&x->a, a, acount, sizeof *a) &&
           dup_into((void **)&x->b, b, acount, sizeof *b);
  if (!ok) {
    release(x);
    return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  }
  gs_job_t job = {run, NULL, release, x};
  const gs_tensor_t *touches = x->in && proto.n ? x->in : x->out;
  gs_status_t s = gs_async_submit_job(&job, touches, touches ? proto.n : 0, request, fn);
  if (s != GS_SUCCESS) release(x);
  return s;
}

static int64_t per_rank(gs_comm_t c, int64_t n) { return n > 0 ? (int64_t)c->size * n : 0; }

/* The in-place collectives: one tensor list (and `also`, a second list of
 * the same length the call reads and writes, or NULL), checked here as far
 * as a copy needs (the blocking call checks the rest). */
static gs_status_t queue_in_place_with(const char *fn, call_ctx_t proto, const gs_tensor_t *t,
                                       const gs_tensor_t *also, gs_request_t *request) {
  gs_clear_error();
  if (!request) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: request is NULL", fn);
  *request = NULL;
  GS_CHECK(gs_comm_valid(proto.comm, fn));
  if (proto.n < 0 || (proto.n > 0 && !t))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: tensors is NULL or n is negative", fn);
  return queue(fn, proto, t, also, 0, NULL, NULL, request);
}

static gs_status_t queue_in_place(const char *fn, call_ctx_t proto, const gs_tensor_t *t,
                                  gs_request_t *request) {
  return queue_in_place_with(fn, proto, t, NULL, request);
}

gs_status_t gs_allreduce_async(gs_comm_t c, const gs_tensor_t *tensors, int64_t n, gs_op_t op,
                               double prescale, double postscale, gs_request_t *request) {
  call_ctx_t p = {
      .kind = CALL_ALLREDUCE, .comm = c, .n = n, .op = op, .pre = prescale, .post = postscale};
  return queue_in_place("gs_allreduce_async", p, tensors, request);
}

gs_status_t gs_allreduce_wire_async(gs_comm_t c, const gs_tensor_t *tensors, int64_t n, gs_op_t op,
                                    double prescale, double postscale, gs_wire_t wire,
                                    const gs_tensor_t *residual, gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_ALLREDUCE_WIRE,
                  .comm = c,
                  .n = n,
                  .op = op,
                  .pre = prescale,
                  .post = postscale,
                  .wire = wire};
  return queue_in_place_with("gs_allreduce_wire_async", p, tensors, residual, request);
}

gs_status_t gs_broadcast_async(gs_comm_t c, const gs_tensor_t *tensors, int64_t n, int root,
                               gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_BROADCAST, .comm = c, .n = n, .root = root};
  return queue_in_place("gs_broadcast_async", p, tensors, request);
}

gs_status_t gs_allgather_shards_async(gs_comm_t c, const gs_tensor_t *tensors, int64_t n,
                                      gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_AG_SHARDS, .comm = c, .n = n};
  return queue_in_place("gs_allgather_shards_async", p, tensors, request);
}

gs_status_t gs_reduce_scatter_shards_async(gs_comm_t c, const gs_tensor_t *tensors, int64_t n,
                                           gs_op_t op, double prescale, double postscale,
                                           gs_request_t *request) {
  call_ctx_t p = {
      .kind = CALL_RS_SHARDS, .comm = c, .n = n, .op = op, .pre = prescale, .post = postscale};
  return queue_in_place("gs_reduce_scatter_shards_async", p, tensors, request);
}

gs_status_t gs_allgatherv_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                                int64_t n, const int64_t *counts, gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_ALLGATHERV, .comm = c, .n = n};
  GS_CHECK(gs_comm_valid(c, "gs_allgatherv_async"));
  return queue("gs_allgatherv_async", p, in, out, per_rank(c, n), counts, NULL, request);
}

gs_status_t gs_reduce_scatter_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                                    int64_t n, const int64_t *rows, gs_op_t op, double prescale,
                                    double postscale, gs_request_t *request) {
  call_ctx_t p = {
      .kind = CALL_REDUCE_SCATTER, .comm = c, .n = n, .op = op, .pre = prescale, .post = postscale};
  return queue("gs_reduce_scatter_async", p, in, out, n, rows, NULL, request);
}

gs_status_t gs_alltoallv_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out,
                               int64_t n, const int64_t *send_counts, const int64_t *recv_counts,
                               gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_ALLTOALLV, .comm = c, .n = n};
  GS_CHECK(gs_comm_valid(c, "gs_alltoallv_async"));
  return queue("gs_alltoallv_async", p, in, out, per_rank(c, n), send_counts, recv_counts, request);
}

gs_status_t gs_gatherv_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                             const int64_t *counts, int root, gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_GATHERV, .comm = c, .n = n, .root = root};
  GS_CHECK(gs_comm_valid(c, "gs_gatherv_async"));
  return queue("gs_gatherv_async", p, in, out, per_rank(c, n), counts, NULL, request);
}

gs_status_t gs_scatterv_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                              const int64_t *counts, int root, gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_SCATTERV, .comm = c, .n = n, .root = root};
  GS_CHECK(gs_comm_valid(c, "gs_scatterv_async"));
  return queue("gs_scatterv_async", p, in, out, per_rank(c, n), counts, NULL, request);
}

gs_status_t gs_reduce_async(gs_comm_t c, const gs_tensor_t *in, const gs_tensor_t *out, int64_t n,
                            gs_op_t op, double prescale, double postscale, int root,
                            gs_request_t *request) {
  call_ctx_t p = {.kind = CALL_REDUCE,
                  .comm = c,
                  .n = n,
                  .op = op,
                  .pre = prescale,
                  .post = postscale,
                  .root = root};
  return queue("gs_reduce_async", p, in, out, 0, NULL, NULL, request);
}
