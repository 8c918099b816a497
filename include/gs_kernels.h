/* gradsync: gradient control kernels on host memory.
 *
 * Each call takes a list of tensors (of pairs, for the accumulators) and runs
 * them as one fused pass; large calls are split across the cores (OpenMP,
 * GRADSYNC_NUM_THREADS or OMP_NUM_THREADS), small ones run on the calling
 * thread. AVX2/F16C kernels are chosen at run time; GRADSYNC_SIMD=none forces
 * the portable ones, which give the same bits. Nothing is written when an
 * argument is rejected. */
#ifndef GRADSYNC_KERNELS_H
#define GRADSYNC_KERNELS_H

#include <stdint.h>

#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every element's bits set to 0 (+0.0), any dtype. */
GS_API gs_status_t gs_zero(const gs_tensor_t *tensors, int64_t n);

/* acc[i] += grad[i] for i < n (pairs), floating dtypes only, equal element
 * counts per pair. Computed in float32 (float64 when either side is float64),
 * rounded once to acc's dtype (round to nearest even). overwrite != 0: acc
 * takes grad's values instead (cast, rounded once). */
GS_API gs_status_t gs_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                                 int overwrite);

/* *finite = 1 when no element of any tensor is NaN or infinite. */
GS_API gs_status_t gs_all_finite(const gs_tensor_t *tensors, int64_t n, int *finite);

/* x *= factor, computed in float32 (float64 for float64), rounded once;
 * floating dtypes only. */
GS_API gs_status_t gs_scale(const gs_tensor_t *tensors, int64_t n, double factor);

#ifdef __cplusplus
}
#endif
#endif
