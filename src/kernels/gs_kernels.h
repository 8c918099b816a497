/* gradsync private, kernels/ (a layer: docs/ARCHITECTURE.md): the host kernels (cpu.c,
 * cpu_*.c) and the CUDA kernels' launchers (cuda.cu; on a machine without a GPU,
 * tests/emulated_cuda). Pure computation: no MPI, no waits, no
 * communicators. The launchers queue one kernel on a stream over tables
 * that already sit in device memory, and return. */
#ifndef GRADSYNC_KERNELS_INTERNAL_H
#define GRADSYNC_KERNELS_INTERNAL_H

#include "base/gs_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- host element kernels (cpu_scale.c, cpu_reduce.c) ---------------------- */

/* dst[i] = src[i] * scale, in float32 (float64 for float64), rounded once to
 * dtype. scale == 1 copies bits. src may equal dst. */
void gs_cpu_scale_copy(gs_dtype_t dtype, const void *src, void *dst, int64_t count, double scale);

/* inout[i] = op(in[i], inout[i]) for sum, min, max, prod (average: sum);
 * float16/bfloat16 combine in float32 and round once. */
void gs_cpu_reduce(gs_dtype_t dtype, gs_op_t op, const void *in, void *inout, int64_t count);

/* ---- low-precision wire formats (cpu_wire.c) --------------------------------
 * A shard of `count` elements takes gs_wire_bytes(wire, count) bytes: two
 * per element (bfloat16, float16), or one per element plus one scale byte
 * per GS_WIRE_BLOCK elements (float8). Blocks start at the shard's start. */
int64_t gs_wire_bytes(gs_wire_t wire, int64_t count);
/* Encodes src into dst (round to nearest even). lost (may be NULL):
 * lost[i] += src[i] - decoded(dst)[i] (0 where that is not finite). */
void gs_wire_encode(gs_wire_t wire, const float *src, int64_t count, void *dst, float *lost);
/* dst[i] = decoded src; acc[i] += decoded src (float32). */
void gs_wire_decode(gs_wire_t wire, const void *src, int64_t count, float *dst);
void gs_wire_decode_add(gs_wire_t wire, const void *src, int64_t count, float *acc);
/* The owner's step over a shard of `count` elements: p encodings of it
 * (rank q's at src + q * stride bytes) decoded and summed in rank order in
 * float32, times post (when not 1), encoded once into dst; out_lost (may be
 * NULL): += the output's rounding. Chunk by chunk, so the sums stay in
 * cache; the bits of decode, decode_add, scale and encode in turn. */
void gs_wire_reduce(gs_wire_t wire, const void *src, size_t stride, int p, int64_t count,
                    float post, void *dst, float *out_lost);
/* float32, float16 or bfloat16 to float32 times scale (float32 arithmetic),
 * and float32 back, rounded once (dst may be src for float32). */
void gs_wire_widen(gs_dtype_t dtype, const void *src, float *dst, int64_t count, double scale);
void gs_wire_narrow(gs_dtype_t dtype, const float *src, void *dst, int64_t count);

/* ---- Adasum's local math (cpu_adasum.c) ------------------------------------
 * out[0..2] += <a,b>, <a,a>, <b,b> in float64; and out = ca*a + cb*b in
 * float64 (float32 for float16/bfloat16), rounded once to the dtype. `out`
 * may be `a` or `b`. */
void gs_cpu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, int64_t n, double out[3]);
void gs_cpu_adasum_combine(gs_dtype_t dtype, double ca, const void *a, double cb, const void *b,
                           void *out, int64_t n);

/* ---- gradient kernels over tensor lists (cpu.c, cpu_simd.c) ------------------
 * Host memory; the arguments are checked by the caller (coll/kernels.c). */
void gs_cpu_zero(const gs_tensor_t *t, int64_t n);
gs_status_t gs_cpu_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                              int overwrite);
/* *any = 1 when an element is NaN or infinite. */
gs_status_t gs_cpu_nonfinite(const gs_tensor_t *t, int64_t n, int *any);
gs_status_t gs_cpu_scale(const gs_tensor_t *t, int64_t n, double factor);

/* Whether the AVX2/F16C kernels run here (CPU support, GRADSYNC_SIMD;
 * cpu_simd.c). */
int gs_simd_avx2(void);

/* ---- the launchers (device tables; no host memory is read) ------------------ */

/* Each launcher returns 0, or the CUDA error the launch reported (the
 * device layer turns it into a status: gs_cu_fail). */

/* Elementwise jobs over a list of (a, b) runs. */
typedef enum gs_cu_mode {
  GS_CU_ZERO = 0,       /* a = +0 (b unused)                                    */
  GS_CU_COPY_SCALE = 1, /* a = b * scale, gs_cpu_scale_copy's arithmetic          */
  GS_CU_ACCUMULATE = 2, /* a += b, gs_accumulate's arithmetic (dtypes may differ) */
  GS_CU_OVERWRITE = 3   /* a = b cast to a's dtype, rounded once                  */
} gs_cu_mode_t;

typedef struct gs_cu_run {
  void *a;
  const void *b;
  int64_t count;
  int32_t adtype, bdtype;
} gs_cu_run_t;

/* A block's work: elements [first, first + count) of run (or slice) `run`. */
typedef struct gs_cu_item {
  int64_t run, first, count;
} gs_cu_item_t;

typedef struct gs_cu_slice {
  int64_t start, count;
} gs_cu_slice_t;

int gs_cu_launch_elementwise(int mode, const gs_cu_run_t *runs, const gs_cu_item_t *items,
                             int64_t nitems, double scale, void *stream);
/* *flag (device memory, zeroed by the caller) becomes 1 when any element of
 * the tensors (device array of descriptors) is NaN or infinite. */
int gs_cu_launch_nonfinite(const gs_tensor_t *t, const gs_cu_item_t *items, int64_t nitems,
                           int *flag, void *stream);
/* Adasum's dot products: partial[3k..] per item, then d[3j..3j+2] = <a,b>,
 * <a,a>, <b,b> of slice j summed over its items first_item[j] ..
 * first_item[j+1]-1 in order (a fixed order: deterministic). */
int gs_cu_launch_dots(int dtype, const void *a, const void *b, const gs_cu_slice_t *slices,
                      const gs_cu_item_t *items, int64_t nitems, const int64_t *first_item,
                      int64_t nslices, double *partial, double *d, void *stream);
/* out = coef[2j]*a + coef[2j+1]*b over slice j, gs_cpu_adasum_combine's arithmetic. */
int gs_cu_launch_combine(int dtype, const void *a, const void *b, void *out,
                         const gs_cu_slice_t *slices, const double *coef, const gs_cu_item_t *items,
                         int64_t nitems, void *stream);
/* Order keys for NaN-propagating min/max over an integer reduction
 * (cuda_pieces.cuh): forward, floats -> keys (gs_cu_key_dtype wide), or
 * inverse, keys -> floats. */
int gs_cu_launch_order_keys(int dtype, int max, int inverse, const void *src, void *dst,
                            int64_t count, void *stream);
/* The wire allreduce's passes over one segment of a message on CUDA memory
 * (transport/mpi/wire.c's algorithm; wire_format.h's layout and arithmetic, so
 * a device has the host's bits). A warp takes a few blocks of 32 elements
 * in turn. */
typedef struct gs_cu_wire_run {
  const void *in;              /* the tensor's elements (the job's dtype) */
  void *out;                   /* where its result goes (may be in) */
  float *residual;             /* error feedback (NULL: none) */
  int64_t offset, count;       /* segment elements [offset, offset + count) */
} gs_cu_wire_run_t;

typedef struct gs_cu_wire_job {
  const gs_cu_wire_run_t *runs; /* device table: by offset, none empty, covering the segment */
  int64_t nruns, n;             /* n: the segment's elements */
  int32_t wire, dtype, p, rank;
  int32_t feedback;             /* some run has a residual */
  float pre, post;              /* applied only when not 1 (the host's rule) */
} gs_cu_wire_job_t;

/* Every shard of the segment: input times pre, plus the residual, encoded
 * into `packed` (the shards back to back); residual = what it lost. */
int gs_cu_launch_wire_encode(gs_cu_wire_job_t job, void *packed, void *stream);
/* This rank's shard: the p contributions in `recv` (rank q's at q times the
 * shard's bytes) decoded and summed in rank order in float32, times post,
 * encoded into its place in `packed`; the residual of each element gains
 * the output's rounding divided by post. */
int gs_cu_launch_wire_reduce(gs_cu_wire_job_t job, const void *recv, void *packed, void *stream);
/* Every shard of `gathered` decoded into the runs' outputs (the job's dtype,
 * rounded once). */
int gs_cu_launch_wire_decode(gs_cu_wire_job_t job, const void *gathered, void *stream);
/* Loads every kernel above into the current context (cudaFuncGetAttributes
 * on each, as NCCL does for its own): under lazy loading (CUDA_MODULE_LOADING
 * =LAZY, the default since CUDA 12.2) a kernel is otherwise loaded at its
 * first launch, and a load while NCCL kernels spin on the device can wait
 * for them forever. Returns 0 or the CUDA error. */
int gs_cu_load_kernels(void);
/* The unsigned integer dtype keys of `dtype` take: 4 or 8 bytes. */
static inline int gs_cu_key_bytes(gs_dtype_t dtype) { return dtype == GS_FLOAT64 ? 8 : 4; }

#ifdef __cplusplus
}
#endif
#endif
