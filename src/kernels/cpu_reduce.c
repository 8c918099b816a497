/* Host reduction kernel: inout[i] = op(in[i], inout[i]). float16 and
 * bfloat16 are widened to float32, combined, and rounded once. Used by the
 * MPI user ops and by the validation message's small payloads. */
#include "kernels/gs_kernels.h"
#include "base/half.h"

/* NaN propagates through min/max as through sum: a non-finite gradient must
 * not be hidden by the reduction. The result does not depend on the order
 * the operands meet in, so every transport gives the same bits: any NaN
 * gives the canonical quiet NaN (+, payload 0; as the NCCL path's order keys
 * do), and -0 is below +0. */
#define CANONICAL_NAN gs_bits_to_float(0x7fc00000u)
#define MIN_NAN(x, y)                                          \
  (((x) != (x) || (y) != (y))                  ? CANONICAL_NAN \
   : ((x) < (y) || ((x) == (y) && signbit(x))) ? (x)           \
                                               : (y))
#define MAX_NAN(x, y)                                           \
  (((x) != (x) || (y) != (y))                   ? CANONICAL_NAN \
   : ((x) > (y) || ((x) == (y) && !signbit(x))) ? (x)           \
                                                : (y))
#define MIN_INT(x, y) ((x) < (y) ? (x) : (y))
#define MAX_INT(x, y) ((x) > (y) ? (x) : (y))

#define LOOP(T, expr)                     \
  do {                                    \
    const T *a_ = in;                     \
    T *b_ = inout;                        \
    for (int64_t i = 0; i < count; i++) { \
      T x = a_[i], y = b_[i];             \
      b_[i] = (T)(expr);                  \
    }                                     \
  } while (0)

#define LOOP_HALF(to_f, from_f, expr)         \
  do {                                        \
    const uint16_t *a_ = in;                  \
    uint16_t *b_ = inout;                     \
    for (int64_t i = 0; i < count; i++) {     \
      float x = to_f(a_[i]), y = to_f(b_[i]); \
      b_[i] = from_f(expr);                   \
    }                                         \
  } while (0)

#define FLOAT_OPS(LOOPER, ...)                                 \
  switch (op) {                                                \
    case GS_OP_MIN: LOOPER(__VA_ARGS__, MIN_NAN(x, y)); break; \
    case GS_OP_MAX: LOOPER(__VA_ARGS__, MAX_NAN(x, y)); break; \
    case GS_OP_PROD: LOOPER(__VA_ARGS__, x * y); break;        \
    default: LOOPER(__VA_ARGS__, x + y); break;                \
  }

/* Integers wrap like MPI's: computed in unsigned arithmetic of the same width
 * (no signed-overflow UB), then converted back. */
#define INT_OPS(T, U)                                  \
  switch (op) {                                        \
    case GS_OP_MIN: LOOP(T, MIN_INT(x, y)); break;     \
    case GS_OP_MAX: LOOP(T, MAX_INT(x, y)); break;     \
    case GS_OP_PROD: LOOP(T, (U)((U)x * (U)y)); break; \
    default: LOOP(T, (U)((U)x + (U)y)); break;         \
  }

void gs_cpu_reduce(gs_dtype_t dtype, gs_op_t op, const void *in, void *inout, int64_t count) {
  switch (dtype) {
    case GS_FLOAT16: FLOAT_OPS(LOOP_HALF, gs_half_to_float, gs_float_to_half); break;
    case GS_BFLOAT16: FLOAT_OPS(LOOP_HALF, gs_bf16_to_float, gs_float_to_bf16); break;
    case GS_FLOAT32: FLOAT_OPS(LOOP, float); break;
    case GS_FLOAT64: FLOAT_OPS(LOOP, double); break;
    case GS_INT8: INT_OPS(int8_t, uint8_t); break;
    case GS_UINT8: INT_OPS(uint8_t, uint8_t); break;
    case GS_INT32: INT_OPS(int32_t, uint32_t); break;
    case GS_INT64: INT_OPS(int64_t, uint64_t); break;
  }
}
