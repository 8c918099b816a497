/* Every environment knob gradsync reads: this is the only file of src/ that
 * calls getenv. Each reader falls back to its default when the variable is
 * unset or unparsable. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs_info.h"
#include "base/gs_base.h"
#include "gs_comm.h"

static int env_int64(const char *name, int64_t *out) {
  const char *s = getenv(name);
  if (!s || !*s) return 0;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (*end != '\0') return 0;
  *out = v;
  return 1;
}

int64_t gs_env_fusion_threshold(void) {
  int64_t v;
  return (env_int64("GRADSYNC_FUSION_THRESHOLD", &v) && v > 0) ? v : GS_DEFAULT_FUSION_THRESHOLD;
}

int64_t gs_env_direct_bytes_for(int spans_hosts) {
  int64_t v;
  if (env_int64("GRADSYNC_DIRECT_BYTES", &v) && v > 0) return v;
  return spans_hosts ? GS_DEFAULT_DIRECT_BYTES_HOSTS : GS_DEFAULT_DIRECT_BYTES;
}

int64_t gs_env_pipeline_bytes_for(int spans_hosts) {
  int64_t v;
  if (env_int64("GRADSYNC_PIPELINE_BYTES", &v) && v >= 0) return v;
  return spans_hosts ? GS_DEFAULT_PIPELINE_BYTES_HOSTS : GS_DEFAULT_PIPELINE_BYTES;
}

int64_t gs_env_cma_bytes(void) {
  int64_t v;
  return (env_int64("GRADSYNC_CMA_BYTES", &v) && v >= 0) ? v : GS_DEFAULT_CMA_BYTES;
}

int64_t gs_env_shm_bytes(void) {
  int64_t v;
  return (env_int64("GRADSYNC_SHM_BYTES", &v) && v >= 0) ? v : GS_DEFAULT_SHM_BYTES;
}

int gs_env_cma_hugepages(void) {
  int64_t v;
  return env_int64("GRADSYNC_CMA_HUGEPAGES", &v) ? v != 0 : 1;
}

int gs_env_simd_portable(void) {
  const char *s = getenv("GRADSYNC_SIMD");
  return s && (strcmp(s, "portable") == 0 || strcmp(s, "none") == 0);
}

int gs_env_check(void) {
  int64_t v;
  return env_int64("GRADSYNC_CHECK", &v) ? (v != 0) : 1;
}

double gs_env_stall_seconds(void) {
  const char *s = getenv("GRADSYNC_STALL_SECONDS");
  if (!s || !*s) return GS_DEFAULT_STALL_SECONDS;
  char *end = NULL;
  double v = strtod(s, &end);
  return (*end == '\0' && v >= 0) ? v : GS_DEFAULT_STALL_SECONDS;
}

long long gs_default_fusion_threshold(void) { return gs_env_fusion_threshold(); }

static double cached_timeout = -1;

void gs_set_timeout_seconds(double seconds) { cached_timeout = seconds > 0 ? seconds : 0.0; }

double gs_env_timeout_seconds(void) {
  double cached = cached_timeout;
  if (cached < 0) {
    const char *s = getenv("GRADSYNC_TIMEOUT_SECONDS");
    char *end = NULL;
    double v = s && *s ? strtod(s, &end) : 0.0;
    cached = cached_timeout = (s && *s && *end == '\0' && v > 0) ? v : 0.0;
  }
  return cached;
}

int gs_env_hierarchy_size(void) {
  int64_t v;
  return (env_int64("GRADSYNC_HIERARCHY_SIZE", &v) && v > 0 && v < (1 << 30)) ? (int)v : 0;
}

int gs_env_hierarchical(void) {
  const char *s = getenv("GRADSYNC_HIERARCHICAL");
  if (!s || !*s || strcmp(s, "auto") == 0) return -1;
  return strcmp(s, "0") != 0;
}

int64_t gs_env_stage_chunk_bytes(void) {
  int64_t v;
  return (env_int64("GRADSYNC_STAGE_CHUNK_BYTES", &v) && v >= 64) ? v
                                                                  : GS_DEFAULT_STAGE_CHUNK_BYTES;
}

int64_t gs_env_mpi_max_count(void) {
  static int64_t cached = 0;
  if (cached == 0) {
    int64_t v;
    cached = (env_int64("GRADSYNC_MPI_MAX_COUNT", &v) && v > 0 && v < INT32_MAX) ? v : INT32_MAX;
  }
  return cached;
}

static const char *env_text(const char *name) {
  const char *s = getenv(name);
  return s && *s ? s : NULL;
}

int gs_env_num_threads(void) {
  int64_t v;
  return (env_int64("GRADSYNC_NUM_THREADS", &v) && v > 0 && v < (1 << 20)) ? (int)v : 0;
}

int gs_env_nccl_off(void) {
  const char *s = env_text("GRADSYNC_NCCL");
  return s && strcmp(s, "0") == 0;
}

int gs_env_cuda_aware_mpi(void) {
  const char *s = env_text("GRADSYNC_CUDA_AWARE_MPI");
  return s ? strcmp(s, "0") != 0 : -1;
}

const char *gs_env_nccl_library(void) { return env_text("GRADSYNC_NCCL_LIBRARY"); }

/* NCCL 2.30+ runs several ranks on one GPU only when this, NCCL's own knob,
 * is 1: gradsync then lets ranks that share a GPU try NCCL too. */
int gs_env_nccl_multi_rank_gpu(void) {
  const char *s = env_text("NCCL_MULTI_RANK_GPU_ENABLE");
  return s && strcmp(s, "1") == 0;
}
int gs_env_debug_nccl(void) { return getenv("GRADSYNC_DEBUG_NCCL") != NULL; }
const char *gs_env_log_level(void) { return env_text("GRADSYNC_LOG_LEVEL"); }
const char *gs_env_timeline(void) { return env_text("GRADSYNC_TIMELINE"); }

int64_t gs_env_flight_entries(void) {
  int64_t v;
  return (env_int64("GRADSYNC_FLIGHT_ENTRIES", &v) && v >= 0 && v <= (1 << 24))
             ? v
             : GS_DEFAULT_FLIGHT_ENTRIES;
}

int gs_env_flight_stacks(void) {
  int64_t v;
  return env_int64("GRADSYNC_FLIGHT_STACKS", &v) && v != 0;
}

const char *gs_env_flight_dir(void) { return env_text("GRADSYNC_FLIGHT_DIR"); }

/* What the ranks of one job share without talking: the scheduler's or the
 * launcher's job id, else the launcher's process on this host (MPICH's
 * hydra proxy, Open MPI's daemon), every local rank's parent. */
const char *gs_env_job_key(char *buf, size_t cap) {
  static const char *const names[] = {"GRADSYNC_JOB_ID",         "SLURM_JOB_ID", "PMIX_NAMESPACE",
                                      "OMPI_MCA_ess_base_jobid", "LSB_JOBID",    "PBS_JOBID"};
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
    const char *s = env_text(names[k]);
    if (s) return s;
  }
  snprintf(buf, cap, "p%ld", (long)getppid());
  return buf;
}

const char *gs_env_tmpdir(void) {
  const char *s = env_text("TMPDIR");
  return s ? s : "/tmp";
}
