/* gradsync: fused collectives over lists of tensors.
 *
 * Every collective takes a list of `n` tensors and treats it as one operation:
 * tensors are grouped by dtype, packed back to back into the communicator's
 * fusion buffer (one offset table per call) and sent as few messages as the
 * fusion threshold allows. A tensor larger than the threshold, and a run of
 * tensors that already sit back to back in memory, are communicated in place.
 *
 * Before communicating, the ranks check that they make the same call (kind,
 * op, root, tensor count, every dtype and element count). A disagreement
 * returns GS_ERR_MISMATCH on every rank and leaves every tensor untouched.
 * An argument error found on one rank returns its own status there and
 * GS_ERR_MISMATCH on the others. */
#ifndef GRADSYNC_COLLECTIVES_H
#define GRADSYNC_COLLECTIVES_H

#include <stdint.h>

#include "gs_comm.h"
#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = op over ranks of (prescale * in[i]), then times postscale
 * (and 1/size for GS_OP_AVERAGE). `out` may be the same array as `in`, or
 * NULL, for an in-place call; otherwise out[i] must match in[i] in count and
 * dtype and must not overlap any input. Scales need floating dtypes. */
GS_API gs_status_t gs_allreduce(gs_comm_t comm, const gs_tensor_t *in,
                                const gs_tensor_t *out, int64_t n, gs_op_t op,
                                double prescale, double postscale);

/* tensors[i] on every rank takes root's values. */
GS_API gs_status_t gs_broadcast(gs_comm_t comm, const gs_tensor_t *tensors,
                                int64_t n, int root);

/* Step 1 of a variable-size allgather: exchanges each rank's element count of
 * each tensor. counts_out receives size * n values, rank-major:
 * counts_out[r * n + i] is rank r's count of tensor i. `row_elems` (may be
 * NULL, meaning 1) is each tensor's elements per row; ranks must agree on it
 * and every count must be a multiple of it. */
GS_API gs_status_t gs_allgather_counts(gs_comm_t comm, const gs_tensor_t *in,
                                       int64_t n, const int64_t *row_elems,
                                       int64_t *counts_out);

/* Step 2: out[i] = concatenation over ranks r of rank r's in[i]. `counts` is
 * what gs_allgather_counts returned; out[i].count must be its column sum. */
GS_API gs_status_t gs_allgatherv(gs_comm_t comm, const gs_tensor_t *in,
                                 const gs_tensor_t *out, int64_t n,
                                 const int64_t *counts);

/* Rank r's out[i] = block r of (op over ranks of in[i]), where in[i] holds
 * rows[i] rows of in[i].count / rows[i] elements each and block r has
 * rows[i] / size + (r < rows[i] % size) rows (`rows` may be NULL: one element
 * per row). out[i].count must be that block's element count. */
GS_API gs_status_t gs_reduce_scatter(gs_comm_t comm, const gs_tensor_t *in,
                                     const gs_tensor_t *out, int64_t n,
                                     const int64_t *rows, gs_op_t op,
                                     double prescale, double postscale);

/* Helper for callers that allocate: the element range [*first, *first + *count)
 * of rank r's block when `rows` rows of `row_elems` elements are split. */
GS_API gs_status_t gs_block_range(int64_t rows, int64_t row_elems, int size,
                                  int rank, int64_t *first, int64_t *count);

#ifdef __cplusplus
}
#endif
#endif
