/* gradsync: ZeRO-style sharded collectives with ONNX Runtime's layout.
 *
 * The tensors of one call share a dtype and are laid out back to back:
 *   total      = sum of counts            align = size * 32 elements
 *   padded     = total + align - total % align   (always adds a block)
 *   rank_count = padded / size            offset_i = sum_{j<i} count_j
 *   owner(i)   = offset_i / rank_count; tensor i must end inside its owner's
 *                range, else GS_ERR_INVALID_ARGUMENT. */
#ifndef GRADSYNC_SHARD_H
#define GRADSYNC_SHARD_H

#include <stdint.h>

#include "gs_comm.h"
#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gs_shard_layout {
  int64_t total;
  int64_t padded;
  int64_t rank_count;
} gs_shard_layout_t;

/* Computes the layout of `n` tensors with element counts `counts` over `size`
 * ranks. offsets and owners (each n entries) may be NULL. */
GS_API gs_status_t gs_shard_layout(const int64_t *counts, int64_t n, int size,
                                   gs_shard_layout_t *layout, int64_t *offsets, int *owners);

/* Every tensor takes its owner's values. */
GS_API gs_status_t gs_allgather_shards(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n);

/* Tensors owned by this rank become the reduction over ranks; the others are
 * left exactly as they were. */
GS_API gs_status_t gs_reduce_scatter_shards(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n,
                                            gs_op_t op, double prescale, double postscale);

#ifdef __cplusplus
}
#endif
#endif
