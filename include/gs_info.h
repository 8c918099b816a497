/* gradsync: what this build of the library contains. */
#ifndef GRADSYNC_INFO_H
#define GRADSYNC_INFO_H

#include "gs_export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "0.1.0" */
GS_API const char *gs_version(void);
/* Best host SIMD level the kernels use on this CPU: "avx2", "portable". */
GS_API const char *gs_simd_level(void);
/* CUDA runtime version compiled in, or 0 when built without CUDA. */
GS_API int gs_cuda_version(void);
/* NCCL version compiled in, or 0 when built without NCCL. */
GS_API int gs_nccl_version(void);
/* The fusion threshold in bytes a communicator gets by default (environment
 * included). */
GS_API long long gs_default_fusion_threshold(void);
/* Allreduces of at most this many bytes (one dtype) travel inside their
 * validation message: one collective does both. */
GS_API int gs_check_payload_bytes(void);

#ifdef __cplusplus
}
#endif
#endif
