/* gradsync: collectives that return at once and complete in the background.
 *
 * An asynchronous call queues the collective and returns a request. One
 * background thread of the runtime runs the queued collectives in the order
 * they were issued (process-wide), each exactly as its blocking twin would,
 * so progress needs no polling by the caller. A blocking collective waits
 * for the queued ones first, which keeps every rank's call order the same
 * and gradsync's MPI calls on one thread at a time: MPI_THREAD_SERIALIZED is
 * enough (and required). Calling MPI yourself while requests are pending
 * needs MPI_THREAD_MULTIPLE.
 *
 * The tensor descriptors are copied; the memory they point to must stay
 * valid and untouched until the request completes. Errors (argument errors
 * and mismatches included) are reported by gs_request_wait/test, on every
 * rank, as the blocking call would report them. */
#ifndef GRADSYNC_ASYNC_H
#define GRADSYNC_ASYNC_H

#include <stdint.h>

#include "gs_comm.h"
#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gs_request *gs_request_t;

/* In-place allreduce of `tensors` (as gs_allreduce with out == NULL). */
GS_API gs_status_t gs_allreduce_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                      gs_op_t op, double prescale, double postscale,
                                      gs_request_t *request);
/* In-place gs_allreduce_wire (residual: NULL, or n float32 tensors kept
 * untouched until the request is done). */
GS_API gs_status_t gs_allreduce_wire_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                           gs_op_t op, double prescale, double postscale,
                                           gs_wire_t wire, const gs_tensor_t *residual,
                                           gs_request_t *request);
GS_API gs_status_t gs_broadcast_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                      int root, gs_request_t *request);
GS_API gs_status_t gs_allgather_shards_async(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                             gs_request_t *request);
GS_API gs_status_t gs_reduce_scatter_shards_async(gs_comm_t comm, const gs_tensor_t *tensors,
                                                  int64_t n, gs_op_t op, double prescale,
                                                  double postscale, gs_request_t *request);

/* *done = 1 once the collective has finished; returns its status then (and
 * GS_SUCCESS while it runs). */
GS_API gs_status_t gs_request_test(gs_request_t request, int *done);
/* Waits for the collective (on CUDA memory: its device work too, polling);
 * returns its status, with its message in gs_last_error(). */
GS_API gs_status_t gs_request_wait(gs_request_t request);
/* For a request on CUDA memory: once its host part has run (waited for as
 * gs_request_wait does), makes `stream` (a cudaStream_t; 1 the legacy
 * default stream, 2 the per-thread one) wait for its device work, without
 * blocking the host: a framework's current stream goes on past the
 * communication the way its own ops would. The background thread still
 * watches the device work (GRADSYNC_TIMEOUT_SECONDS); an error there is
 * reported by gs_request_test/wait and the communicator's next call. Host
 * memory: gs_request_wait. */
GS_API gs_status_t gs_request_wait_stream(gs_request_t request, uintptr_t stream);
/* Once the host part has run: the cudaStream_t the request's device work is
 * queued on while it is still pending (its communicator's stream, valid
 * until that communicator is freed; for exporting its results with that
 * stream), else NULL. */
GS_API gs_status_t gs_request_stream(gs_request_t request, void **stream);
/* Waits if needed, then frees the request; *request becomes NULL. */
GS_API gs_status_t gs_request_free(gs_request_t *request);
/* Requests queued or running, process-wide. */
GS_API int64_t gs_requests_pending(void);

/* The other collectives, in the background (as their blocking twins in
 * gs_collectives.h; count arrays are copied). */
GS_API gs_status_t gs_allgatherv_async(gs_comm_t comm, const gs_tensor_t *in,
                                       const gs_tensor_t *out, int64_t n, const int64_t *counts,
                                       gs_request_t *request);
GS_API gs_status_t gs_reduce_scatter_async(gs_comm_t comm, const gs_tensor_t *in,
                                           const gs_tensor_t *out, int64_t n, const int64_t *rows,
                                           gs_op_t op, double prescale, double postscale,
                                           gs_request_t *request);
GS_API gs_status_t gs_alltoallv_async(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                      int64_t n, const int64_t *send_counts,
                                      const int64_t *recv_counts, gs_request_t *request);
GS_API gs_status_t gs_gatherv_async(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                    int64_t n, const int64_t *counts, int root,
                                    gs_request_t *request);
GS_API gs_status_t gs_scatterv_async(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                     int64_t n, const int64_t *counts, int root,
                                     gs_request_t *request);
GS_API gs_status_t gs_reduce_async(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                   int64_t n, gs_op_t op, double prescale, double postscale,
                                   int root, gs_request_t *request);

#ifdef __cplusplus
}
#endif
#endif
