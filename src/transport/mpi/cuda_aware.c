/* The CUDA-aware MPI transport: device buffers straight into MPI, data
 * movement always; reductions when the op is MPI's own (gradsync's
 * float16/bfloat16 and NaN-aware min/max ops run on the host, so those go
 * through pinned staging instead). */
#include "transport/mpi/gs_mpi_transport.h"

int gs_mpi_cuda_aware(void) {
  static int known = -1;
  if (known >= 0) return known;
  int env = gs_env_cuda_aware_mpi();
  if (env >= 0) return known = env;
  known = 0;
#if defined(MPIX_GPU_SUPPORT_CUDA)
  int yes = 0; /* MPICH 4+: asks the library as built and configured */
  if (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &yes) == MPI_SUCCESS) known = yes != 0;
#endif
  return known;
}

/* MPI reads device memory itself: the kernels queued before (packing) must
 * have finished first. */
static gs_status_t device_ready(gs_comm_t c) {
  return c->dev_stream ? gs_cu_stream_wait(c->dev_stream, "gradsync: before CUDA-aware MPI")
                       : GS_SUCCESS;
}

static gs_status_t aware_allreduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                                   gs_dtype_t dtype, gs_op_t op) {
  if (!gs_mpi_op_is_builtin(dtype, op))
    return gs_staged_transport.allreduce(c, send, recv, count, dtype, op);
  GS_CHECK(device_ready(c));
  return gs_mpi_native_allreduce(c, send, recv, count, dtype, op);
}

static gs_status_t aware_broadcast(gs_comm_t c, void *buf, int64_t count, gs_dtype_t dtype,
                                   int root) {
  GS_CHECK(device_ready(c));
  return gs_mpi_transport.broadcast(c, buf, count, dtype, root);
}

static gs_status_t aware_allgatherv(gs_comm_t c, void *recv, const int64_t *counts,
                                    const int64_t *displs, gs_dtype_t dtype) {
  GS_CHECK(device_ready(c));
  return gs_mpi_transport.allgatherv(c, recv, counts, displs, dtype);
}

static gs_status_t aware_reduce_scatter(gs_comm_t c, const void *send, void *recv,
                                        const int64_t *counts, gs_dtype_t dtype, gs_op_t op) {
  if (!gs_mpi_op_is_builtin(dtype, op))
    return gs_staged_transport.reduce_scatter(c, send, recv, counts, dtype, op);
  GS_CHECK(device_ready(c));
  return gs_mpi_transport.reduce_scatter(c, send, recv, counts, dtype, op);
}

static gs_status_t aware_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                                  int64_t rcount, gs_dtype_t dtype, int peer) {
  GS_CHECK(device_ready(c));
  return gs_mpi_transport.exchange(c, sbuf, scount, rbuf, rcount, dtype, peer);
}

/* The work queued on the stream ends on the host side: an event is all
 * there is to poll. */
static int aware_poll(gs_comm_t c, void *event, const char *what, gs_status_t *err) {
  return gs_staged_transport.poll(c, event, what, err);
}

const gs_transport_t gs_cuda_aware_transport = {
    .name = "mpi-cuda-aware",
    .allreduce = aware_allreduce,
    .broadcast = aware_broadcast,
    .allgatherv = aware_allgatherv,
    .reduce_scatter = aware_reduce_scatter,
    .exchange = aware_exchange,
    .poll = aware_poll,
};
