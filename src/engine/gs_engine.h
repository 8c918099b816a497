/* gradsync private, engine/ (a layer: docs/ARCHITECTURE.md): where a call's data lives and which
 * path moves it (path.c), every buffer a communicator keeps (buffers.c),
 * and the fusion plan with its pack and unpack (fusion.c). */
#ifndef GRADSYNC_ENGINE_H
#define GRADSYNC_ENGINE_H

#include "transport/gs_transport.h"

/* ---- where a call's data lives (path.c) ----------------------------------
 * Every collective opens an engine after validation: host memory goes to the
 * MPI transport and the host kernels; CUDA memory to NCCL or staged MPI and
 * the CUDA kernels, queued on the communicator's stream and awaited at close. */
typedef struct gs_engine {
  gs_comm_t comm;
  const char *call;  /* the collective's name, for the timeline and messages */
  int device;        /* CUDA ordinal; -1: host memory */
  gs_cu_scope_t scope; /* the device entered for the call, left at close */
  void *stream;      /* the communicator's stream */
  const gs_transport_t *transport;
} gs_engine_t;

/* A device call's completion, handed to the asynchronous worker's request
 * instead of waited for (set by the worker around each job). `ready`: an
 * event recorded on the submitter's work stream at submission, which the
 * call's device work follows. */
typedef struct gs_device_done {
  void *ready;
  void *event;
  void *stream; /* the communicator's, where the event was recorded */
  gs_comm_t comm;
  const gs_transport_t *transport;
  int device;
} gs_device_done_t;
extern _Thread_local gs_device_done_t *gs_defer_device;
/* Waits for device work up to `event` through the transport's poll, with
 * gs_progress_wait's timeouts and interrupts; on giving up the transport
 * aborts and `c` becomes unusable. */
gs_status_t gs_device_wait(gs_comm_t c, const gs_transport_t *tr, void *event, const char *what);

/* Local check before validation: in and out on the same memory, and CUDA
 * memory on the device this communicator serves. */
gs_status_t gs_check_memory(gs_comm_t c, const char *fn, const gs_tensor_t *a, int64_t na,
                            const gs_tensor_t *b, int64_t nb);
gs_status_t gs_engine_open(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_engine_t *e);
/* Waits for the call's device work; returns `s`, or the wait's error. */
gs_status_t gs_engine_close(gs_engine_t *e, gs_status_t s);
static inline int gs_engine_on_device(const gs_engine_t *e) { return e->device >= 0; }
/* dst = src * scale over count elements (gs_cpu_scale_copy's arithmetic). */
gs_status_t gs_scale_copy(const gs_engine_t *e, gs_dtype_t dtype, const void *src, void *dst,
                          int64_t count, double scale);
/* Many copies of one dtype, dst = src * scale (1.0: bits): one launch on a
 * device. */
typedef struct gs_copy {
  void *dst;
  const void *src;
  int64_t count;
} gs_copy_t;
gs_status_t gs_copy_batch(const gs_engine_t *e, gs_dtype_t dtype, const gs_copy_t *copies,
                          int64_t n, double scale);
/* Sets `bytes` bytes at dst to zero in the engine's memory. */
gs_status_t gs_zero_bytes(const gs_engine_t *e, void *dst, size_t bytes);
/* Frees the device path at gs_comm_free: waits for the communicator's last
 * GPU work (polled, through its transport), then finalizes NCCL (polled)
 * and frees the stream and device buffers. When the wait fails, NCCL is
 * aborted instead and the stream and buffers are kept (the device may still
 * use them); c is then unusable and the wait's status returned. */
gs_status_t gs_device_path_free(gs_comm_t c);

/* ---- buffers (buffers.c): every buffer a communicator keeps ----------------
 * All grow by one rule (gs_grow_size) and live until gs_comm_free. */
/* The fusion buffer in the engine's memory. */
gs_status_t gs_buffer_reserve(const gs_engine_t *e, size_t bytes, void **buf);
/* Scratch (Adasum's received halves, an empty block's stand-in) in the
 * engine's memory. */
gs_status_t gs_scratch_reserve(const gs_engine_t *e, size_t bytes, void **buf);
/* Frees the host buffers (the device ones go with gs_device_path_free). */
void gs_buffers_free(gs_comm_t c);

/* ---- fusion engine (fusion.c) ------------------------------------------ */

/* One call's offset table. Tensors are grouped by dtype (groups in order of
 * first appearance, tensors in list order inside a group); slot k places
 * tensor `slots[k].tensor` at element `slots[k].offset` of its message. */
typedef struct gs_slot {
  int64_t tensor;
  int64_t offset; /* elements from the start of the message */
  int64_t count;  /* elements this slot occupies in the message */
} gs_slot_t;

typedef struct gs_message {
  gs_dtype_t dtype;
  int64_t first; /* first slot */
  int64_t nslots;
  int64_t count; /* elements in the message */
} gs_message_t;

#define GS_PLAN_INLINE 8 /* lists this short plan without touching the heap */

typedef struct gs_plan {
  gs_slot_t *slots;
  gs_message_t *msgs;
  int64_t nslots, nmsgs;
  gs_slot_t inline_slots[GS_PLAN_INLINE];
  gs_message_t inline_msgs[GS_PLAN_INLINE];
} gs_plan_t;

/* Builds the table for tensors whose sizes are `counts` (n values) and
 * dtypes `dtypes`: a tensor over `threshold` bytes, or of at least `direct`
 * bytes, gets its own message (and is never copied); others are packed until
 * the next would pass the threshold. */
gs_status_t gs_plan_build(gs_plan_t *plan, const int64_t *counts, const gs_dtype_t *dtypes,
                          int64_t n, int64_t threshold, int64_t direct);
void gs_plan_free(gs_plan_t *plan);
/* gs_plan_build over the counts and dtypes of a tensor list, with the
 * communicator's thresholds; fuse_direct: no tensor goes alone for being
 * of the direct size (a call whose kernels read every tensor where it lies
 * gains nothing from it, and pays per message). */
gs_status_t gs_plan_tensors(gs_plan_t *plan, const gs_tensor_t *t, int64_t n, gs_comm_t comm,
                            int fuse_direct);

/* Whether message m's tensors sit back to back in `t`'s memory, in slot
 * order; *base receives the first element's address. */
int gs_plan_contiguous(const gs_plan_t *plan, const gs_message_t *m, const gs_tensor_t *t,
                       void **base);

/* Copies message m's tensors from `t` into buf, times `scale` (1.0: plain
 * copy), rounded once to the dtype; on a device, in one launch. */
gs_status_t gs_pack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                    const gs_tensor_t *t, void *buf, double scale);
/* Host memory: the rank-order fold of p packed copies of the message
 * (bufs[r] + at: rank r's, in the host's shared region) written into `t`,
 * times `scale`: t = ((b0 op b1) op b2) ..., the unpack and the reduction in
 * one pass, a cache-sized piece at a time. */
void gs_unpack_fold(const gs_plan_t *plan, const gs_message_t *m, const void *const *bufs,
                    size_t at, int p, gs_op_t op, const gs_tensor_t *t, double scale);
/* Copies buf back out into `t`, times `scale`. */
gs_status_t gs_unpack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                      const void *buf, const gs_tensor_t *t, double scale);
/* The same for message elements [first, first + count) only; buf holds
 * just those (element first at buf[0]): a window of a piece's size. */
gs_status_t gs_pack_range(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                          const gs_tensor_t *t, void *buf, double scale, int64_t first,
                          int64_t count);
gs_status_t gs_unpack_range(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                            const void *buf, const gs_tensor_t *t, double scale, int64_t first,
                            int64_t count);

#endif
