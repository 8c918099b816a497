/* gradsync private declarations shared by the files of src/. Not installed. */
#ifndef GRADSYNC_INTERNAL_H
#define GRADSYNC_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "gradsync.h"
#include "gs_cuda.h"

/* ---- errors (status.c) ------------------------------------------------- */

/* Records a formatted message as this thread's last error; returns status. */
gs_status_t gs_fail(gs_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Clears the last error (start of a successful public call). */
void gs_clear_error(void);

#define GS_CHECK(call)                   \
  do {                                   \
    gs_status_t gs_check_s_ = (call);    \
    if (gs_check_s_ != GS_SUCCESS)       \
      return gs_check_s_;                \
  } while (0)

#define GS_CHECK_GOTO(call, status_var, label) \
  do {                                         \
    (status_var) = (call);                     \
    if ((status_var) != GS_SUCCESS) goto label;\
  } while (0)

/* Turns an MPI error code into GS_ERR_MPI with MPI's own message. */
gs_status_t gs_mpi_fail(int mpi_err, const char *what);
#define GS_MPI_CHECK(call, what)                           \
  do {                                                     \
    int gs_mpi_e_ = (call);                                \
    if (gs_mpi_e_ != MPI_SUCCESS) return gs_mpi_fail(gs_mpi_e_, (what)); \
  } while (0)

/* ---- environment knobs (env.c): the one place that reads them ------------ */

#define GS_DEFAULT_FUSION_THRESHOLD ((int64_t)134217728) /* 128 MiB */
#define GS_DEFAULT_STALL_SECONDS 60.0
/* Copying a tensor into the fusion buffer and back costs more than sending
 * it as its own message once it passes a few hundred KiB (two memcpy passes
 * against one message's latency), so such tensors are never packed. */
#define GS_DEFAULT_DIRECT_BYTES ((int64_t)262144)
int64_t gs_env_direct_bytes(void);     /* GRADSYNC_DIRECT_BYTES */
/* Device data staged through host memory moves in pieces this large, so
 * copies overlap MPI (4 MiB: PCIe and shared-memory MPI both near peak). */
#define GS_DEFAULT_STAGE_CHUNK_BYTES ((int64_t)4 << 20)
int64_t gs_env_stage_chunk_bytes(void); /* GRADSYNC_STAGE_CHUNK_BYTES */
int64_t gs_env_fusion_threshold(void); /* GRADSYNC_FUSION_THRESHOLD */
int gs_env_check(void);                /* GRADSYNC_CHECK */
double gs_env_stall_seconds(void);     /* GRADSYNC_STALL_SECONDS */
int gs_env_simd_portable(void);        /* GRADSYNC_SIMD=portable: no AVX2 kernels */
double gs_env_timeout_seconds(void);   /* GRADSYNC_TIMEOUT_SECONDS; 0: none */

/* ---- dtypes and element conversions (dtype.c, half.h) ------------------- */

int gs_dtype_valid(gs_dtype_t dtype);
/* p + off bytes; p itself for off 0, so an empty tensor's NULL data never
 * takes part in pointer arithmetic (undefined in C even for + 0). */
static inline void *gs_at(const void *p, size_t off) {
  return off ? (void *)((const char *)p + off) : (void *)p;
}
static inline int gs_op_is_adasum(gs_op_t op) {
  return op == GS_OP_ADASUM || op == GS_OP_ADASUM_HIERARCHICAL;
}
/* Ranks per averaging group of hierarchical Adasum: GRADSYNC_HIERARCHY_SIZE,
 * else 0 (then: the ranks of a node). */
int gs_env_hierarchy_size(void);
int gs_dtype_is_float(gs_dtype_t dtype);

/* ---- communicator (comm.c) --------------------------------------------- */

struct gs_comm {
  uint32_t magic;          /* GS_COMM_MAGIC while alive: catches stale handles */
  MPI_Comm mpi;            /* our duplicate: all collectives go here */
  MPI_Comm notice;         /* second duplicate: stall notices, point to point */
  int rank, size, local_rank, local_size;
  int64_t fusion_threshold;
  int64_t direct_bytes;    /* tensors of at least this many bytes go alone */
  int check;
  int owns_core;           /* ranks on this node <= its cores: spinning is cheap */
  double stall_seconds;
  uint64_t seq;            /* checked calls made so far: names a call in notices */
  gs_comm_stats_t stats;
  MPI_Comm *adasum_levels; /* level k: blocks of 2^(k+1) ranks; cached */
  int adasum_nlevels;
  void *adasum_tmp;        /* received halves, grows on demand */
  size_t adasum_tmp_bytes;
  void *fusion;            /* persistent fusion buffer, grows on demand */
  size_t fusion_bytes;
  /* CUDA memory (engine.c): the path is chosen at the first such call */
  int dev_path;            /* GS_PATH_* */
  int dev_id;              /* the CUDA device this communicator serves */
  void *dev_stream;
  void *nccl;              /* ncclComm_t on GS_PATH_NCCL */
  void *dev_fusion;        /* device fusion buffer */
  size_t dev_fusion_bytes;
  void *dev_tmp;           /* device scratch: Adasum's received halves */
  size_t dev_tmp_bytes;
  void *dev_keys;          /* device scratch: NCCL min/max order keys */
  size_t dev_keys_bytes;
  void *pinned;            /* pinned host staging for GS_PATH_STAGED */
  size_t pinned_bytes;
  gs_status_t broken;      /* a wait was abandoned (timeout, interrupt): unusable */
};
enum { GS_PATH_NONE = 0, GS_PATH_NCCL = 1, GS_PATH_STAGED = 2, GS_PATH_CUDA_AWARE = 3 };
#define GS_COMM_MAGIC 0x67736331u /* "gsc1" */

/* Validates a handle at an API entry point. */
gs_status_t gs_comm_valid(gs_comm_t comm, const char *where);
/* gs_comm_valid, plus: a communicator that timed out or was interrupted
 * stays unusable (its ranks may be mid-collective). */
gs_status_t gs_comm_enter(gs_comm_t comm, const char *where);
void gs_async_drain(void);
/* Waits for the device work of finished asynchronous requests on `c` (its
 * free is next). */
void gs_async_settle_comm(gs_comm_t c);
int gs_async_in_worker(void);
/* Every public collective runs between these (async.c): they wait for queued
 * asynchronous collectives, then hold the runtime lock, which keeps
 * gradsync's MPI calls one at a time across threads (MPI_THREAD_SERIALIZED).
 * Waits release it between polls (gs_runtime_pause), so threads driving
 * different communicators all progress. Nested entries are counted. */
void gs_enter_runtime(void);
void gs_leave_runtime(void);
/* Lets other threads in while this one waits (sleeping nap_us microseconds,
 * or just yielding for 0); returns with the lock again. */
void gs_runtime_pause(int nap_us);
/* More than one application thread has entered the runtime: blocking MPI
 * calls (which would hold the lock while waiting) are then avoided. */
int gs_runtime_shared(void);
/* Checked while waiting (GRADSYNC_TIMEOUT_SECONDS, interrupts); sets
 * c->broken when the wait is abandoned. */
extern _Thread_local gs_comm_t gs_current_comm;
/* Makes the fusion buffer at least `bytes` long; *buf receives it. */
gs_status_t gs_fusion_reserve(gs_comm_t comm, size_t bytes, void **buf);

/* ---- logging (log.c): GRADSYNC_LOG_LEVEL ----------------------------------- */
enum { GS_LOG_ERROR = 0, GS_LOG_WARNING = 1, GS_LOG_INFO = 2, GS_LOG_DEBUG = 3 };
int gs_log_level(void);
void gs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- timeline (timeline.c) ------------------------------------------------
 * Phases are timed only while recording: off, each costs one branch. Row 0
 * holds whole-call phases (validation), row k the k-th fused message. */
extern int gs_tl_on;
void gs_tl_event(const char *name, const char *call, int64_t row, double start, int64_t bytes);
void gs_timeline_from_env(void);
#define GS_TL_START() (gs_tl_on ? gs_now() : 0.0)
#define GS_TL_END(name, call, row, t0, bytes)                          \
  do {                                                                 \
    if ((t0) != 0.0) gs_tl_event((name), (call), (row), (t0), (bytes)); \
  } while (0)

/* ---- the MPI transport (mpi_transport.c) ---------------------------------
 * Every call takes 64-bit counts and splits them into chunks MPI's int counts
 * can carry. `op` here is a reduction (sum, min, max, prod): average and the
 * scales are applied by the fusion engine. */

gs_status_t gs_mpi_datatype(gs_dtype_t dtype, MPI_Datatype *out);

/* ---- waiting (progress.c): every wait on every transport ------------------- */

/* What a wait polls. poll: 1 done, 0 not yet, -1 failed (*err set, message
 * recorded). abandon (may be NULL): called when the wait gives up (timeout,
 * interrupt) to cancel or abort what is pending. tick (may be NULL): about
 * every 128 polls with the seconds waited. detail (may be NULL): more words
 * for the timeout message (NCCL's last error). */
typedef struct gs_wait {
  int (*poll)(void *ctx, gs_status_t *err);
  void (*abandon)(void *ctx, gs_status_t why);
  void (*tick)(void *ctx, double waited);
  const char *(*detail)(void *ctx);
  void *ctx;
  const char *what;
} gs_wait_t;
/* Polls until done, yielding the core and releasing the runtime lock between
 * polls; GRADSYNC_TIMEOUT_SECONDS and interrupts end it with GS_ERR_TIMEOUT
 * or GS_ERR_INTERRUPTED and leave the current communicator unusable. */
gs_status_t gs_progress_wait(const gs_wait_t *w);

/* Called while waiting on an MPI request, about every 128 polls, with the
 * seconds waited so far; may complete the request itself (then sets *done). */
typedef void (*gs_wait_tick)(void *ctx, MPI_Request *req, int *done, double waited);
/* Completes a nonblocking MPI call through gs_progress_wait; on giving up
 * the request is cancelled. `tick` may be NULL. */
gs_status_t gs_mpi_wait(MPI_Request *req, const char *what, gs_wait_tick tick, void *ctx);

/* Messages below this size use MPI's blocking calls when every rank has a
 * core of its own: they are cheapest there (MPICH 5, 2 ranks: 16 floats
 * 0.27 us blocking, 0.7 us nonblocking). Larger ones, and all of them on an
 * oversubscribed node, are nonblocking with the yielding wait (16 MiB:
 * 57.8 ms blocking, 4.8 ms nonblocking). */
#define GS_BLOCKING_MAX_BYTES ((int64_t)65536)
int gs_use_blocking(gs_comm_t comm, int64_t bytes);
/* Monotonic seconds. */
double gs_now(void);
gs_status_t gs_mpi_op(gs_dtype_t dtype, gs_op_t op, MPI_Op *out);

typedef struct gs_transport {
  const char *name;
  /* send == NULL: in place on recv. */
  gs_status_t (*allreduce)(gs_comm_t, const void *send, void *recv,
                           int64_t count, gs_dtype_t, gs_op_t);
  gs_status_t (*broadcast)(gs_comm_t, void *buf, int64_t count, gs_dtype_t,
                           int root);
  /* recv holds size blocks: block r has counts[r] elements at displs[r].
   * This rank's block is already in place in recv. */
  gs_status_t (*allgatherv)(gs_comm_t, void *recv, const int64_t *counts,
                            const int64_t *displs, gs_dtype_t);
  /* send holds size blocks (counts[r] elements each, back to back); recv
   * gets this rank's block reduced. */
  gs_status_t (*reduce_scatter)(gs_comm_t, const void *send, void *recv,
                                const int64_t *counts, gs_dtype_t, gs_op_t);
  /* Device transports (NULL for host memory): whether the work queued on the
   * communicator's stream up to `event` has finished (1), not yet (0), or
   * failed (-1, *err set, message recorded); abort (may be NULL): what to do
   * when a wait gives up on it; detail (may be NULL): the transport's own
   * words on its last error, for messages. */
  int (*poll)(gs_comm_t, void *event, gs_status_t *err);
  void (*abort)(gs_comm_t, gs_status_t why);
  const char *(*detail)(gs_comm_t);
} gs_transport_t;

extern const gs_transport_t gs_mpi_transport;

/* NCCL (nccl.c): opened at run time; these fail cleanly when it is absent. */
extern const gs_transport_t gs_nccl_transport;
/* Device buffers straight to a CUDA-aware MPI (mpi_transport.c): detected
 * with MPIX_GPU_query_support, or GRADSYNC_CUDA_AWARE_MPI=0/1. */
extern const gs_transport_t gs_cuda_aware_transport;
int gs_mpi_cuda_aware(void);
/* The op is MPI's own (no gradsync host operator behind it). */
int gs_mpi_op_is_builtin(gs_dtype_t dtype, gs_op_t op);
/* MPI over host staging for device buffers (staged.c). */
extern const gs_transport_t gs_staged_transport;
/* The staged and CUDA-aware transports' poll: the event alone. */
int gs_staged_poll(gs_comm_t c, void *event, gs_status_t *err);
typedef gs_status_t (*gs_exchange_fn)(gs_comm_t, const void *, int64_t, void *, int64_t,
                                      gs_dtype_t, int);
/* A pairwise exchange of device buffers through pinned memory, by `host_exchange`. */
gs_status_t gs_staged_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                               int64_t rcount, gs_dtype_t dtype, int peer,
                               gs_exchange_fn host_exchange);
int gs_nccl_loadable(void);
gs_status_t gs_nccl_comm_init(gs_comm_t c);           /* collective over c->mpi */
void gs_nccl_comm_free(gs_comm_t c);
/* Sends scount elements to `peer` and receives rcount from it (either may be
 * 0), device memory, on c->dev_stream. */
gs_status_t gs_nccl_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                             int64_t rcount, gs_dtype_t dtype, int peer);

/* ---- where a call's data lives (engine.c) --------------------------------
 * Every collective opens an engine after validation: host memory goes to the
 * MPI transport and the host kernels; CUDA memory to NCCL or staged MPI and
 * the CUDA kernels, queued on gradsync's stream and awaited at close. */
typedef struct gs_engine {
  gs_comm_t comm;
  const char *call;  /* the collective's name, for the timeline and messages */
  int device;        /* CUDA ordinal; -1: host memory */
  gs_cu_scope_t scope; /* the device entered for the call, left at close */
  void *stream;      /* the communication stream */
  const gs_transport_t *transport;
} gs_engine_t;

/* A device call's completion, handed to the asynchronous worker's request
 * instead of waited for (set by the worker around each job). `ready`: an
 * event recorded on the submitter's work stream at submission, which the
 * call's device work follows. */
typedef struct gs_device_done {
  void *ready;
  void *event;
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
/* The fusion buffer in the engine's memory. */
gs_status_t gs_buffer_reserve(const gs_engine_t *e, size_t bytes, void **buf);
/* Adasum's scratch in the engine's memory. */
gs_status_t gs_scratch_reserve(const gs_engine_t *e, size_t bytes, void **buf);
void gs_device_path_free(gs_comm_t c);
/* The CUDA side of the kernels API (engine.c). */
gs_status_t gs_device_zero(const gs_tensor_t *t, int64_t n);
gs_status_t gs_device_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                                 int overwrite);
gs_status_t gs_device_all_finite(const gs_tensor_t *t, int64_t n, int *finite);
gs_status_t gs_device_scale(const gs_tensor_t *t, int64_t n, double factor);

/* ---- cross-rank validation (check.c) ------------------------------------ */

typedef enum gs_call_kind {
  GS_CALL_BARRIER = 1,
  GS_CALL_ALLREDUCE = 2,
  GS_CALL_BROADCAST = 3,
  GS_CALL_ALLGATHER_COUNTS = 4,
  GS_CALL_ALLGATHERV = 5,
  GS_CALL_REDUCE_SCATTER = 6,
  GS_CALL_ALLGATHER_SHARDS = 7,
  GS_CALL_REDUCE_SCATTER_SHARDS = 8,
  GS_CALL_ALLTOALL_COUNTS = 9,
  GS_CALL_ALLTOALLV = 10,
  GS_CALL_GATHERV = 11,
  GS_CALL_SCATTERV = 12,
  GS_CALL_REDUCE = 13
} gs_call_kind_t;

const char *gs_call_name(gs_call_kind_t kind);

/* Calls whose whole data fits here travel inside the validation message: one
 * collective validates and reduces them (small allreduces, latency bound). */
/* 128 bytes: a loss/metrics vector fits, and the message (288 bytes) stays
 * cheap for calls that carry none. */
#define GS_CHECK_PAYLOAD_BYTES 128

/* The validation messages' merge: signatures, and where both sides agree and
 * carry a payload, the payloads (check.c). MPI_User_function's shape. */
void gs_check_combine(void *in, void *inout, int *len, MPI_Datatype *dt);

/* A small allreduce riding in the validation message: `data` holds the packed
 * input (count elements of dtype); on success it holds the reduction. */
typedef struct gs_payload {
  void *data;
  int64_t count;
  gs_dtype_t dtype;
  gs_op_t op;
} gs_payload_t;

/* What a rank is about to do. `extra` (n values, may be NULL) is one more
 * per-tensor number the ranks must agree on (row size for allgather, rows for
 * reduce_scatter). */
typedef struct gs_call {
  gs_call_kind_t kind;
  gs_op_t op;
  int root;
  int64_t n;
  const gs_tensor_t *tensors;
  const int64_t *extra;
  const char *extra_name;
  int counts_vary;         /* element counts may differ by rank (allgather) */
} gs_call_t;

/* Meets the other ranks and compares calls. `local` is GS_SUCCESS or the
 * argument error this rank found (with gs_last_error() set): the rank still
 * takes part so nobody waits, and gets its own error back. Returns
 * GS_ERR_MISMATCH with a message naming what differs and which ranks. */
gs_status_t gs_check_call(gs_comm_t comm, const gs_call_t *call,
                          gs_status_t local, gs_payload_t *payload);

/* gs_check_call when validation is on; otherwise just returns `local`. */
gs_status_t gs_begin_call(gs_comm_t comm, const gs_call_t *call, gs_status_t local);

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
gs_status_t gs_plan_build(gs_plan_t *plan, const int64_t *counts,
                          const gs_dtype_t *dtypes, int64_t n,
                          int64_t threshold, int64_t direct);
void gs_plan_free(gs_plan_t *plan);
/* gs_plan_build over the counts and dtypes of a tensor list. */
gs_status_t gs_plan_tensors(gs_plan_t *plan, const gs_tensor_t *t, int64_t n,
                            gs_comm_t comm);

/* Whether message m's tensors sit back to back in `t`'s memory, in slot
 * order; *base receives the first element's address. */
int gs_plan_contiguous(const gs_plan_t *plan, const gs_message_t *m,
                       const gs_tensor_t *t, void **base);

/* Copies message m's tensors from `t` into buf, times `scale` (1.0: plain
 * copy), rounded once to the dtype; on a device, in one launch. */
struct gs_engine;
gs_status_t gs_pack(const struct gs_engine *e, const gs_plan_t *plan, const gs_message_t *m,
                    const gs_tensor_t *t, void *buf, double scale);
/* Copies buf back out into `t`, times `scale`. */
gs_status_t gs_unpack(const struct gs_engine *e, const gs_plan_t *plan, const gs_message_t *m,
                      const void *buf, const gs_tensor_t *t, double scale);

/* ---- host element kernels (cpu_scale.c) --------------------------------- */

/* dst[i] = src[i] * scale, in float32 (float64 for float64), rounded once to
 * dtype. scale == 1 copies bits. src may equal dst. */
void gs_cpu_scale_copy(gs_dtype_t dtype, const void *src, void *dst,
                       int64_t count, double scale);

/* inout[i] = op(in[i], inout[i]) for sum, min, max, prod (average: sum);
 * float16/bfloat16 combine in float32 and round once. */
void gs_cpu_reduce(gs_dtype_t dtype, gs_op_t op, const void *in, void *inout, int64_t count);

/* Adasum's local math (cpu_adasum.c): out[0..2] += <a,b>, <a,a>, <b,b> in
 * float64; and out = ca*a + cb*b in float64 (float32 for float16/bfloat16),
 * rounded once to the dtype. `out` may be `a` or `b`. */
void gs_cpu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, int64_t n,
                        double out[3]);
void gs_cpu_adasum_combine(gs_dtype_t dtype, double ca, const void *a, double cb,
                           const void *b, void *out, int64_t n);

/* ---- Adasum (adasum.c) --------------------------------------------------- */

/* Adasum over one message held contiguously in `x` (the message's elements,
 * tensor boundaries from the plan's slots). The result replaces x on every
 * rank. */
gs_status_t gs_adasum_message(const struct gs_engine *e, const gs_plan_t *plan,
                              const gs_message_t *m, void *x, int sum_levels);
/* Hierarchical Adasum's group size for this communicator, or an argument
 * error naming the unmet condition (checked before the ranks meet). */
gs_status_t gs_adasum_group_size(gs_comm_t comm, const char *fn, int *size);
/* Frees the per-level communicators Adasum caches on a communicator. */
void gs_adasum_free(gs_comm_t comm);

/* ---- argument checks shared by the collectives (args.c) ----------------- */

/* Checks a tensor list for one call; `name` names it in messages ("in",
 * "tensors"). Floating scales/ops need floating dtypes. */
gs_status_t gs_check_tensors(const char *op_name, const char *name,
                             const gs_tensor_t *t, int64_t n);
gs_status_t gs_check_op(const char *op_name, gs_op_t op, const gs_tensor_t *t,
                        int64_t n, double prescale, double postscale, int allow_adasum);
/* out[i] must match in[i] in count and dtype. */
gs_status_t gs_check_outputs(const char *op_name, const gs_tensor_t *in,
                             const gs_tensor_t *out, int64_t n);
/* out[i] (written) is in[i] exactly or overlaps no in[j] and no other out[j];
 * the names are the arguments' in messages (gs_accumulate's acc and grad). */
gs_status_t gs_check_pairs_disjoint(const char *op_name, const char *in_name,
                                    const gs_tensor_t *in, const char *out_name,
                                    const gs_tensor_t *out, int64_t n);
/* No out[i] overlaps another output or any input (not even its own). */
gs_status_t gs_check_disjoint(const char *op_name, const gs_tensor_t *in,
                              const gs_tensor_t *out, int64_t n);

/* ---- the exchange collectives: alltoallv, gatherv, scatterv, reduce -------
 * (alltoall.c, rooted.c call xfer.c, which moves the data in the engine's
 * memory: MPI's own collective while every count and displacement fits MPI's
 * int (agreed by all ranks: `native`), else pairwise exchanges in chunks;
 * device memory through NCCL send/recv, CUDA-aware MPI, or pinned staging).
 * When the transports are restructured these become gs_transport_t entries. */

/* The most elements one MPI call carries (INT_MAX; GRADSYNC_MPI_MAX_COUNT
 * lowers it, so tests reach the 64-bit paths with small arrays). */
int64_t gs_env_mpi_max_count(void);

/* One tensor's movement. Per-rank arrays have comm->size entries. */
typedef struct gs_xfer {
  gs_dtype_t dtype;
  int root;                         /* gatherv, scatterv */
  const void *send;
  void *recv;
  const int64_t *scounts, *sdispls; /* alltoallv; scatterv at the root */
  const int64_t *rcounts, *rdispls; /* alltoallv; gatherv at the root */
  int64_t scount, rcount;           /* gatherv's send, scatterv's receive */
  int native;                       /* MPI's own collective (all counts fit int) */
} gs_xfer_t;

gs_status_t gs_xfer_alltoallv(const gs_engine_t *e, const gs_xfer_t *x);
gs_status_t gs_xfer_gatherv(const gs_engine_t *e, const gs_xfer_t *x);
gs_status_t gs_xfer_scatterv(const gs_engine_t *e, const gs_xfer_t *x);
/* recv (root only) = op over ranks of send; send == recv at the root: in place. */
gs_status_t gs_xfer_reduce(const gs_engine_t *e, const void *send, void *recv, int64_t count,
                           gs_dtype_t dtype, gs_op_t op, int root);

/* Host MPI (mpi_xfer.c): MPI's own collectives (counts must fit int), and a
 * chunked pairwise exchange with any peer (either side may be empty). */
gs_status_t gs_mpi_alltoallv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_gatherv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_scatterv(gs_comm_t c, const gs_xfer_t *x);
gs_status_t gs_mpi_reduce(gs_comm_t c, const void *send, void *recv, int64_t count,
                          gs_dtype_t dtype, gs_op_t op, int root);
gs_status_t gs_mpi_exchange(gs_comm_t c, const void *sbuf, int64_t scount, void *rbuf,
                            int64_t rcount, gs_dtype_t dtype, int peer);
/* An MPI datatype carrying `count` elements in one message (a derived type
 * past GRADSYNC_MPI_MAX_COUNT): *n is the count to pass with *type, and
 * *derived says the caller must MPI_Type_free it. */
gs_status_t gs_mpi_big_type(gs_dtype_t dtype, int64_t count, MPI_Datatype *type, int *n,
                            int *derived);
/* A 64-bit hash of a few values (validation signatures of count vectors). */
uint64_t gs_hash_mix(uint64_t h, uint64_t v);

/* ---- requests that are not one of async.c's queued collectives ------------
 * A job either runs on the background thread in issue order like the other
 * asynchronous collectives (`run`), or is driven by whoever tests or waits
 * on its request (`poll`, for point-to-point messages, which must not queue
 * behind collectives). `release` frees ctx once the request is freed. */
typedef struct gs_job {
  gs_status_t (*run)(void *ctx);
  gs_status_t (*poll)(void *ctx, int wait, int *done);
  void (*release)(void *ctx);
  void *ctx;
} gs_job_t;
/* Queues job->run (or, with run NULL, makes a polled request). `touches`
 * (n tensors, may be NULL) are the memory the job uses: on a CUDA device the
 * job is ordered after the submitter's work stream as of now. On failure the
 * caller still owns job->ctx. */
gs_status_t gs_async_submit_job(gs_comm_t comm, const gs_job_t *job, const gs_tensor_t *touches,
                                int64_t n, gs_request_t *request, const char *fn);
/* gs_enter_runtime without waiting for queued collectives first: for
 * point-to-point calls, which are not ordered with collectives. */
void gs_enter_runtime_unordered(void);

#endif
