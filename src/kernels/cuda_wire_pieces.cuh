/* What one lane of a warp does in the wire allreduce's kernels (cuda.cu),
 * as plain C++ over (block, lane): a warp takes a run of blocks of
 * GS_WIRE_BLOCK (32) elements one after another, a lane one element of
 * each. A float8 block's scale needs the block's largest magnitude, so
 * encoding is two steps around a reduction across the lanes: the kernel
 * does it with warp shuffles, the emulated runtime (tests/emulated_cuda) by
 * running the lanes in turn. The element arithmetic and the layout are
 * wire_format.h's, the host encoder's.
 *
 * Speed: the per-warp work is small, so what a block costs is its index
 * arithmetic and the search for each element's tensor. The shard layout
 * is worked out once per warp (gs_wire_layout: one division per block after),
 * and each lane keeps a cursor into the runs that moves forward with its
 * elements (a binary search only for the warp's first element). */
#ifndef GRADSYNC_CUDA_WIRE_PIECES_CUH
#define GRADSYNC_CUDA_WIRE_PIECES_CUH

#include "kernels/cuda_pieces.cuh"
#include "kernels/wire_format.h"

namespace gs_wire_pieces {

/* Blocks per warp: enough to amortize the warp's setup, few enough that
 * ResNet-50's list still gives every SM many warps. */
constexpr int kBlocksPerWarp = 8;

typedef gs_wire_layout_t Layout;

GS_HD inline Layout layout(const gs_cu_wire_job_t &j) { return gs_wire_layout(j.wire, j.n, j.p); }

/* The run holding segment element e (runs sorted by offset, none empty). */
GS_HD inline int64_t run_index(const gs_cu_wire_job_t &j, int64_t e) {
  int64_t lo = 0, hi = j.nruns - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (j.runs[mid].offset <= e) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* The run holding e, from a cursor at or before it (moved forward). */
GS_HD inline const gs_cu_wire_run_t &seek(const gs_cu_wire_job_t &j, int64_t e, int64_t *cursor) {
  while (j.runs[*cursor].offset + j.runs[*cursor].count <= e) ++*cursor;
  return j.runs[*cursor];
}

GS_HD inline float load_float(int dtype, const void *p, int64_t i) {
  if (dtype == GS_FLOAT16) return gs_half_to_float(((const uint16_t *)p)[i]);
  if (dtype == GS_BFLOAT16) return gs_bf16_to_float(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

GS_HD inline void store_float(int dtype, void *p, int64_t i, float v) {
  if (dtype == GS_FLOAT16) ((uint16_t *)p)[i] = gs_float_to_half(v);
  else if (dtype == GS_BFLOAT16) ((uint16_t *)p)[i] = gs_float_to_bf16(v);
  else ((float *)p)[i] = v;
}

/* A wire value's bits to float32; `up` the block's scale (float8). */
GS_HD inline float decode(int wire, const uint8_t *base, int64_t elem, int64_t i, float up) {
  if (wire == GS_WIRE_BFLOAT16) return gs_bf16_to_float(((const uint16_t *)base)[elem + i]);
  if (wire == GS_WIRE_FLOAT16) return gs_half_to_float(((const uint16_t *)base)[elem + i]);
  gs_fp8_format_t f = gs_fp8_format(wire);
  return gs_from_fp8(&f, base[elem + i]) * up;
}

/* Elements in block b of a shard or segment of n elements. */
GS_HD inline int block_len(int64_t n, int64_t b) {
  int64_t left = n - b * GS_WIRE_BLOCK;
  return (int)(left < GS_WIRE_BLOCK ? left : GS_WIRE_BLOCK);
}

/* v encoded at its place (scale exponent s for float8); returns the
 * decoded value, which error feedback compares with v. */
GS_HD inline float encode(int wire, uint8_t *base, int64_t elem, int64_t i, float v, int s) {
  if (wire == GS_WIRE_BFLOAT16 || wire == GS_WIRE_FLOAT16) {
    uint16_t h = wire == GS_WIRE_BFLOAT16 ? gs_float_to_bf16(v) : gs_float_to_half(v);
    ((uint16_t *)base)[elem + i] = h;
    return wire == GS_WIRE_BFLOAT16 ? gs_bf16_to_float(h) : gs_half_to_float(h);
  }
  gs_fp8_format_t f = gs_fp8_format(wire);
  uint8_t code = gs_to_fp8_bits(&f, v * gs_pow2f(-s));
  base[elem + i] = code;
  return gs_from_fp8(&f, code) * gs_pow2f(s);
}

/* The scale exponent of a float8 block whose largest finite magnitude is
 * m (0 for 16-bit wires), its byte written where `write` (one lane). */
GS_HD inline int put_scale(int wire, uint8_t *base, int64_t at, float m, bool write) {
  if (!gs_wire_is_fp8(wire)) return 0;
  gs_fp8_format_t f = gs_fp8_format(wire);
  int s = gs_wire_scale_exponent(&f, m);
  if (write) base[at] = (uint8_t)(s + 127);
  return s;
}

/* ---- encode: segment block b, this lane's element ------------------------ */

/* Step 1: the lane's input (widened, times pre, plus the residual) into *x;
 * returns its magnitude for the block's scale (0 past the segment). */
GS_HD inline float encode_load(const gs_cu_wire_job_t &j, int64_t b, int lane, int64_t *cursor,
                               float *x) {
  int64_t e = b * GS_WIRE_BLOCK + lane;
  *x = 0.0f;
  if (lane >= block_len(j.n, b)) return 0.0f;
  const gs_cu_wire_run_t &r = seek(j, e, cursor);
  float v = load_float(j.dtype, r.in, e - r.offset);
  if (j.pre != 1.0f) v = v * j.pre;
  if (r.residual) v = v + r.residual[e - r.offset];
  *x = v;
  return gs_wire_magnitude(v);
}

/* Step 2, with the block's largest magnitude m: the element (and lane 0 the
 * scale) into the packing; the residual becomes what the encoding lost. */
GS_HD inline void encode_store(const gs_cu_wire_job_t &j, const Layout &L, uint8_t *packed,
                               int64_t b, int lane, int64_t cursor, float x, float m) {
  gs_wire_place_t w = gs_wire_place(&L, b);
  int s = put_scale(j.wire, packed, w.scale, m, lane == 0);
  if (lane >= block_len(j.n, b)) return;
  float q = encode(j.wire, packed, w.elem, lane, x, s);
  const gs_cu_wire_run_t &r = j.runs[cursor]; /* encode_load's */
  if (r.residual) r.residual[b * GS_WIRE_BLOCK + lane - r.offset] = 0.0f + gs_wire_lost(x, q);
}

/* ---- reduce: block lb of this rank's shard -------------------------------- */

/* Step 1: the p contributions of the lane's element, decoded and summed in
 * rank order, times post, into *acc; returns its magnitude. first and
 * count: this rank's shard. */
GS_HD inline float reduce_load(const gs_cu_wire_job_t &j, int64_t count, const uint8_t *recv,
                               int64_t lb, int lane, float *acc) {
  *acc = 0.0f;
  if (lane >= block_len(count, lb)) return 0.0f;
  int64_t bytes = gs_wire_shard_bytes(j.wire, count);
  int fp8 = gs_wire_is_fp8(j.wire);
  int64_t elem = (fp8 ? (count + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK : 0) + lb * GS_WIRE_BLOCK;
  float sum = 0.0f;
  for (int q = 0; q < j.p; q++) {
    const uint8_t *c = recv + q * bytes;
    float up = fp8 ? gs_pow2f((int)c[lb] - 127) : 1.0f;
    float v = decode(j.wire, c, elem, lane, up);
    sum = q == 0 ? v : sum + v;
  }
  if (j.post != 1.0f) sum = sum * j.post;
  *acc = sum;
  return gs_wire_magnitude(sum);
}

/* Step 2: the sum encoded once into the shard's place in `packed`; the
 * output's rounding, divided by post, added to the element's residual. */
GS_HD inline void reduce_store(const gs_cu_wire_job_t &j, const Layout &L, int64_t first,
                               int64_t count, uint8_t *packed, int64_t lb, int lane,
                               int64_t *cursor, float acc, float m) {
  gs_wire_place_t w = gs_wire_place(&L, first / GS_WIRE_BLOCK + lb);
  int s = put_scale(j.wire, packed, w.scale, m, lane == 0);
  if (lane >= block_len(count, lb)) return;
  float q = encode(j.wire, packed, w.elem, lane, acc, s);
  if (!j.feedback || j.post == 0.0f) return;
  int64_t e = first + lb * GS_WIRE_BLOCK + lane;
  const gs_cu_wire_run_t &r = seek(j, e, cursor);
  if (r.residual)
    r.residual[e - r.offset] = r.residual[e - r.offset] + (0.0f + gs_wire_lost(acc, q)) / j.post;
}

/* ---- decode: segment block b into the outputs ------------------------------ */

GS_HD inline void decode_lane(const gs_cu_wire_job_t &j, const Layout &L, const uint8_t *gathered,
                              int64_t b, int lane, int64_t *cursor) {
  if (lane >= block_len(j.n, b)) return;
  gs_wire_place_t w = gs_wire_place(&L, b);
  float up = gs_wire_is_fp8(j.wire) ? gs_pow2f((int)gathered[w.scale] - 127) : 1.0f;
  float v = decode(j.wire, gathered, w.elem, lane, up);
  int64_t e = b * GS_WIRE_BLOCK + lane;
  const gs_cu_wire_run_t &r = seek(j, e, cursor);
  store_float(j.dtype, r.out, e - r.offset, v);
}

}  // namespace gs_wire_pieces

#endif
