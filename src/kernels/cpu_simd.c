/* Which host kernels run here: AVX2/F16C where the CPU has them, unless
 * GRADSYNC_SIMD=portable asks for the portable loops. */
#include <string.h>

#include "gs_info.h"
#include "kernels/gs_kernels.h"

const char *gs_simd_level(void) {
  if (gs_env_simd_portable()) return "portable";
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return "avx2";
#endif
  return "portable";
}

int gs_simd_avx2(void) { return strcmp(gs_simd_level(), "avx2") == 0; }
