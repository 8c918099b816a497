/* gradsync private, engine/ (a layer: docs/ARCHITECTURE.md): the background thread that runs
 * queued jobs in issue order, the requests that track them (device work
 * included), and entering the runtime, which lets queued jobs finish first
 * (queue.c). */
#ifndef GRADSYNC_QUEUE_H
#define GRADSYNC_QUEUE_H

#include "gs_async.h"
#include "engine/gs_engine.h"

/* Every public call runs between these: gs_enter_runtime waits for queued
 * asynchronous jobs (their order is the order the ranks agree on), then
 * takes the runtime lock. Nested entries are counted. */
void gs_enter_runtime(void);
void gs_leave_runtime(void);
/* gs_enter_runtime without waiting for queued jobs: for point-to-point
 * calls, which are not ordered with collectives. */
void gs_enter_runtime_unordered(void);
/* Waits for the device work of finished requests on `c` (its free is next). */
void gs_async_settle_comm(gs_comm_t c);

/* A job either runs on the background thread in issue order (`run`), or is
 * driven by whoever tests or waits on its request (`poll`, for
 * point-to-point messages, which must not queue behind collectives).
 * `release` frees ctx once the request is freed. */
typedef struct gs_job {
  gs_status_t (*run)(void *ctx);
  gs_status_t (*poll)(void *ctx, int wait, int *done);
  void (*release)(void *ctx);
  void *ctx;
} gs_job_t;
/* Queues job->run (or, with run NULL, makes a polled request). `touches`
 * (n tensors, may be NULL) are the memory the job uses: on a CUDA device the
 * job is ordered after the submitter's work stream as of now. `fn` names
 * the request in messages. On failure the caller still owns job->ctx. */
gs_status_t gs_async_submit_job(const gs_job_t *job, const gs_tensor_t *touches, int64_t n,
                                gs_request_t *request, const char *fn);

#endif
