/* gradsync private, base/ (a layer: docs/ARCHITECTURE.md): status and the last error, logging,
 * every environment knob, dtypes, the clock and the timeline recorder.
 * Needs neither MPI nor CUDA, so the CUDA sources include it too. */
#ifndef GRADSYNC_BASE_H
#define GRADSYNC_BASE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "gs_status.h"
#include "gs_timeline.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors (status.c) ------------------------------------------------- */

/* The longest last error kept (longer ones are cut). */
#define GS_ERROR_MAX 2048
/* Records a formatted message as this thread's last error; returns status. */
gs_status_t gs_fail(gs_status_t status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* gs_fail(GS_ERR_PEER_LOST, ...), recording the lost ranks for
 * gs_last_lost_ranks (up to 64 of them). */
gs_status_t gs_fail_lost(const int *ranks, int n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Clears the last error (start of a successful public call). */
void gs_clear_error(void);

#define GS_CHECK(call)                                 \
  do {                                                 \
    gs_status_t gs_check_s_ = (call);                  \
    if (gs_check_s_ != GS_SUCCESS) return gs_check_s_; \
  } while (0)

/* ---- logging (log.c): GRADSYNC_LOG_LEVEL --------------------------------- */

enum { GS_LOG_ERROR = 0, GS_LOG_WARNING = 1, GS_LOG_INFO = 2, GS_LOG_DEBUG = 3 };
int gs_log_level(void);
void gs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The rank log lines name (gs_comm_set_world's; -1: MPI_COMM_WORLD's): in a
 * world joined from singletons every process is rank 0 of its own. */
void gs_log_set_rank(int rank);

/* ---- environment knobs (env.c): the only file that calls getenv --------- */

#define GS_DEFAULT_FUSION_THRESHOLD ((int64_t)134217728) /* 128 MiB */
#define GS_DEFAULT_STALL_SECONDS 60.0
/* Copying a tensor into the fusion buffer and back costs more than sending
 * it as its own message once it passes a few hundred KiB (two memcpy passes
 * against one message's latency), so such tensors are never packed. */
#define GS_DEFAULT_DIRECT_BYTES ((int64_t)262144)
/* Across hosts each message pays a network round trip and a pipeline fill,
 * which outweigh packing copies for far larger tensors (docs/CLUSTER.md):
 * the default for communicators that span hosts. */
#define GS_DEFAULT_DIRECT_BYTES_HOSTS ((int64_t)16 << 20)
/* Host allreduce messages larger than this go in pieces of this size, each
 * packed, reduced and scaled while it is in cache (docs/PERFORMANCE.md,
 * "Pipelined host allreduce"). Across hosts MPI's own large-message
 * algorithms already pipeline and every piece costs a network latency: 0
 * (whole messages). */
#define GS_DEFAULT_PIPELINE_BYTES ((int64_t)1 << 20)
#define GS_DEFAULT_PIPELINE_BYTES_HOSTS ((int64_t)0)
/* Device data staged through host memory moves in pieces this large, so
 * copies overlap MPI (4 MiB: PCIe and shared-memory MPI both near peak). */
#define GS_DEFAULT_STAGE_CHUNK_BYTES ((int64_t)4 << 20)

int64_t gs_env_direct_bytes_for(int spans_hosts); /* GRADSYNC_DIRECT_BYTES */
int64_t gs_env_pipeline_bytes_for(int spans_hosts); /* GRADSYNC_PIPELINE_BYTES (0: off) */
int64_t gs_env_stage_chunk_bytes(void);           /* GRADSYNC_STAGE_CHUNK_BYTES */
/* Allreduces inside one host from this many bytes read the peers' memory
 * (cma.c); 0: never. */
#define GS_DEFAULT_CMA_BYTES ((int64_t)1 << 20)
int64_t gs_env_cma_bytes(void);                   /* GRADSYNC_CMA_BYTES */
/* A slot of the host's shared region: a call's data riding in validation
 * (transport/shm/); one page more than GS_DEFAULT_CMA_BYTES, so every
 * allreduce below the cross-memory path's threshold fits. */
#define GS_DEFAULT_SHM_BYTES (GS_DEFAULT_CMA_BYTES + 4096)
int64_t gs_env_shm_bytes(void);                   /* GRADSYNC_SHM_BYTES */
int gs_env_cma_hugepages(void);                   /* GRADSYNC_CMA_HUGEPAGES (default 1) */
int64_t gs_env_fusion_threshold(void);            /* GRADSYNC_FUSION_THRESHOLD */
int gs_env_check(void);                           /* GRADSYNC_CHECK */
double gs_env_stall_seconds(void);                /* GRADSYNC_STALL_SECONDS */
int gs_env_simd_portable(void);      /* GRADSYNC_SIMD=portable: no AVX2 kernels */
double gs_env_timeout_seconds(void); /* GRADSYNC_TIMEOUT_SECONDS (or the setter); 0: none */
/* GRADSYNC_HIERARCHY_SIZE: ranks per host of hierarchical Adasum and the
 * hierarchical allreduce, else 0 (then: the ranks of a node). */
int gs_env_hierarchy_size(void);
/* GRADSYNC_HIERARCHICAL: 0 flat, 1 hierarchical where the hosts allow it,
 * -1 (unset, "auto"): hierarchical for messages worth it across hosts. */
int gs_env_hierarchical(void);
/* GRADSYNC_MPI_MAX_COUNT: the most elements one MPI call carries (INT_MAX
 * unless lowered, so tests reach the 64-bit paths with small arrays). */
int64_t gs_env_mpi_max_count(void);
int gs_env_num_threads(void);         /* GRADSYNC_NUM_THREADS; 0: unset */
int gs_env_nccl_off(void);            /* GRADSYNC_NCCL=0 */
int gs_env_cuda_aware_mpi(void);      /* GRADSYNC_CUDA_AWARE_MPI: 0, 1; -1 unset */
const char *gs_env_nccl_library(void); /* GRADSYNC_NCCL_LIBRARY, or NULL */
int gs_env_nccl_multi_rank_gpu(void);  /* NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL's) */
int gs_env_debug_nccl(void);          /* GRADSYNC_DEBUG_NCCL set */
const char *gs_env_log_level(void);   /* GRADSYNC_LOG_LEVEL, or NULL */
const char *gs_env_timeline(void);    /* GRADSYNC_TIMELINE, or NULL */
/* The flight recorder's ring: a few thousand calls (about 0.5 MiB) cover
 * minutes of a training loop's collectives. */
#define GS_DEFAULT_FLIGHT_ENTRIES ((int64_t)4096)
int64_t gs_env_flight_entries(void); /* GRADSYNC_FLIGHT_ENTRIES (0: off) */
int gs_env_flight_stacks(void);      /* GRADSYNC_FLIGHT_STACKS=1: callers' Python stacks */
const char *gs_env_flight_dir(void); /* GRADSYNC_FLIGHT_DIR, or NULL */
/* A name the ranks of one job share (the job id, else the launcher's pid). */
const char *gs_env_job_key(char *buf, size_t cap);
const char *gs_env_tmpdir(void);     /* TMPDIR, else /tmp */

/* ---- dtypes and ops (dtype.c) ------------------------------------------- */

int gs_dtype_valid(gs_dtype_t dtype);
int gs_dtype_is_float(gs_dtype_t dtype);
/* p + off bytes; p itself for off 0, so an empty tensor's NULL data never
 * takes part in pointer arithmetic (undefined in C even for + 0). */
static inline void *gs_at(const void *p, size_t off) {
  return off ? (void *)((const char *)p + off) : (void *)p;
}
static inline int gs_op_is_adasum(gs_op_t op) {
  return op == GS_OP_ADASUM || op == GS_OP_ADASUM_HIERARCHICAL;
}
/* The size a buffer of `have` bytes grows to when `need` bytes are wanted:
 * at least twice `have` (a slowly growing workload reallocates rarely), at
 * least 4 KiB, a multiple of 64 bytes. The one growth rule of every buffer. */
static inline size_t gs_grow_size(size_t have, size_t need) {
  size_t want = need < 2 * have ? 2 * have : need;
  want = want < 4096 ? 4096 : want;
  return (want + 63) & ~(size_t)63;
}
/* A 64-bit hash of a few values (validation signatures of count vectors,
 * tensor lists): splitmix64's finalizer over a running value. Inline: every
 * validated call hashes each of its tensors. */
static inline uint64_t gs_hash_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

/* ---- the clock (clock.c) -------------------------------------------------- */

double gs_now(void); /* monotonic seconds */

/* ---- timeline (timeline.c) ------------------------------------------------
 * Phases are timed only while recording: off, each costs one branch. Row 0
 * holds whole-call phases (validation), row k the k-th fused message. */
extern int gs_tl_on;
void gs_tl_event(const char *name, const char *call, int64_t row, double start, int64_t bytes);
void gs_timeline_from_env(void);
#define GS_TL_START() (gs_tl_on ? gs_now() : 0.0)
#define GS_TL_END(name, call, row, t0, bytes)                           \
  do {                                                                  \
    if ((t0) != 0.0) gs_tl_event((name), (call), (row), (t0), (bytes)); \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
