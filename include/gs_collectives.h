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
GS_API gs_status_t gs_allreduce(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                int64_t n, gs_op_t op, double prescale, double postscale);

/* gs_allreduce with the data on the wire in `wire`'s format (host memory;
 * op sum or average; float32 tensors, or float16/bfloat16 ones with a
 * float8 wire). Each rank encodes every peer's shard of the prescaled input
 * and sends it straight to that peer; the owner decodes all ranks'
 * contributions, sums them in float32 in rank order, applies the postscale,
 * rounds once to the wire format, and an allgather returns the rounded
 * shard, which every rank decodes. The error is one rounding of each input
 * and one of the output, whatever the rank count, and every rank gets the
 * same bits. GS_WIRE_NONE is gs_allreduce.
 *
 * residual (may be NULL) is error feedback, one float32 tensor per input
 * with its count: on entry it is added to the prescaled input; on return it
 * holds what this call's roundings lost of it (this rank's input rounding,
 * plus the output rounding of the shard this rank owned, divided by the
 * postscale), to be passed to the next call. Zero it before the first. */
GS_API gs_status_t gs_allreduce_wire(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                     int64_t n, gs_op_t op, double prescale, double postscale,
                                     gs_wire_t wire, const gs_tensor_t *residual);

/* tensors[i] on every rank takes root's values. */
GS_API gs_status_t gs_broadcast(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int root);

/* Step 1 of a variable-size allgather: exchanges each rank's element count of
 * each tensor. counts_out receives size * n values, rank-major:
 * counts_out[r * n + i] is rank r's count of tensor i. `row_elems` (may be
 * NULL, meaning 1) is each tensor's elements per row; ranks must agree on it
 * and every count must be a multiple of it. */
GS_API gs_status_t gs_allgather_counts(gs_comm_t comm, const gs_tensor_t *in, int64_t n,
                                       const int64_t *row_elems, int64_t *counts_out);

/* Step 1 by rows, for tensors whose rows may hold zero elements (shape
 * (k, 0)), which element counts cannot describe: rows[i] is this rank's dim
 * 0 of tensor i and row_elems[i] its elements per row (>= 0; ranks must
 * agree on it; in[i].count must be rows[i] * row_elems[i]). rows_out
 * receives size * n values, rank-major: rank r's rows of tensor i. */
GS_API gs_status_t gs_allgather_rows(gs_comm_t comm, const gs_tensor_t *in, int64_t n,
                                     const int64_t *rows, const int64_t *row_elems,
                                     int64_t *rows_out);

/* Step 2: out[i] = concatenation over ranks r of rank r's in[i]. `counts` is
 * what gs_allgather_counts returned; out[i].count must be its column sum. */
GS_API gs_status_t gs_allgatherv(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                 int64_t n, const int64_t *counts);

/* Rank r's out[i] = block r of (op over ranks of in[i]), where in[i] holds
 * rows[i] rows of in[i].count / rows[i] elements each and block r has
 * rows[i] / size + (r < rows[i] % size) rows (`rows` may be NULL: one element
 * per row). out[i].count must be that block's element count. */
GS_API gs_status_t gs_reduce_scatter(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                     int64_t n, const int64_t *rows, gs_op_t op, double prescale,
                                     double postscale);

/* Helper for callers that allocate: the element range [*first, *first + *count)
 * of rank r's block when `rows` rows of `row_elems` elements are split. */
GS_API gs_status_t gs_block_range(int64_t rows, int64_t row_elems, int size, int rank,
                                  int64_t *first, int64_t *count);

/* ---- all-to-all, gather, scatter, reduce ------------------------------------
 * Count arrays are rank-major like gs_allgatherv's: counts[r * n + i] is
 * rank r's entry for tensor i. Every tensor is its own message (no fusion),
 * except in gs_reduce, which fuses like gs_allreduce. The ranks validate as
 * for the other collectives; with validation on they also check that the
 * counts agree (what rank s sends rank d is what rank d expects), so a count
 * mismatch returns GS_ERR_MISMATCH on every rank before any data moves. */

/* Step 1 of an all-to-all whose receive counts are not known: rank d's
 * recv_counts[s * n + i] = rank s's send_counts[d * n + i]. Counts are in any
 * unit (rows or elements). `row_elems` (may be NULL) is each tensor's
 * elements per row, which the ranks must agree on. */
GS_API gs_status_t gs_alltoall_counts(gs_comm_t comm, const gs_tensor_t *in, int64_t n,
                                      const int64_t *row_elems, const int64_t *send_counts,
                                      int64_t *recv_counts);

/* in[i] holds size blocks back to back, block r (send_counts[r * n + i]
 * elements) for rank r; out[i] receives the blocks sent to this rank, in
 * rank order (recv_counts[r * n + i] elements from rank r). Counts in
 * elements. out must not overlap any input. */
GS_API gs_status_t gs_alltoallv(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                                int64_t n, const int64_t *send_counts, const int64_t *recv_counts);

/* At `root`, out[i] = concatenation over ranks r of rank r's in[i], which
 * has counts[r * n + i] elements. Every rank passes the same counts; out is
 * read at the root only (NULL elsewhere is fine). */
GS_API gs_status_t gs_gatherv(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                              int64_t n, const int64_t *counts, int root);

/* Rank r's out[i] = block r of root's in[i] (counts[r * n + i] elements, the
 * blocks back to back in rank order). Every rank passes the same counts; in
 * is read at the root only (NULL elsewhere is fine). */
GS_API gs_status_t gs_scatterv(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                               int64_t n, const int64_t *counts, int root);

/* At `root`, out[i] = op over ranks of (prescale * in[i]), times postscale
 * (and 1/size for GS_OP_AVERAGE), as gs_allreduce computes it (no Adasum).
 * out may be NULL or `in` at the root for an in-place result; it is not read
 * elsewhere. in is never written except in place at the root. */
GS_API gs_status_t gs_reduce(gs_comm_t comm, const gs_tensor_t *in, const gs_tensor_t *out,
                             int64_t n, gs_op_t op, double prescale, double postscale, int root);

#ifdef __cplusplus
}
#endif
#endif
