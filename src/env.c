/* The environment knobs, read in one place. Each reader falls back to its
 * default when the variable is unset or unparsable. */
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"

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
  return (env_int64("GRADSYNC_FUSION_THRESHOLD", &v) && v > 0)
             ? v : GS_DEFAULT_FUSION_THRESHOLD;
}

int64_t gs_env_direct_bytes(void) {
  int64_t v;
  return (env_int64("GRADSYNC_DIRECT_BYTES", &v) && v > 0) ? v : GS_DEFAULT_DIRECT_BYTES;
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

int64_t gs_env_stage_chunk_bytes(void) {
  int64_t v;
  return (env_int64("GRADSYNC_STAGE_CHUNK_BYTES", &v) && v >= 64) ? v : GS_DEFAULT_STAGE_CHUNK_BYTES;
}

int64_t gs_env_mpi_max_count(void) {
  static int64_t cached = 0;
  if (cached == 0) {
    int64_t v;
    cached = (env_int64("GRADSYNC_MPI_MAX_COUNT", &v) && v > 0 && v < INT32_MAX) ? v : INT32_MAX;
  }
  return cached;
}
