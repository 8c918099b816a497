/* What this build contains. */
#include <string.h>

#include "gs_internal.h"
#include "simd.h"

const char *gs_version(void) { return GS_VERSION_STRING; }

const char *gs_simd_level(void) {
  if (gs_env_simd_portable()) return "portable";
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return "avx2";
#endif
  return "portable";
}

int gs_simd_avx2(void) { return strcmp(gs_simd_level(), "avx2") == 0; }

int gs_check_payload_bytes(void) { return GS_CHECK_PAYLOAD_BYTES; }

