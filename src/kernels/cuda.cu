/* The CUDA kernels and their launchers: gradient control, fusion-buffer
 * packing, Adasum's local math and min/max order keys. Every launcher queues
 * one kernel (or two, for the dot products) on the stream it is given over
 * tables already in device memory (device/jobs.c uploads them), and returns:
 * nothing here waits or reads host memory. Block b does work item b. What
 * one thread does is cuda_pieces.cuh's (also run on the host by the tests);
 * the build passes --fmad=false, so results have the host kernels' bits
 * except Adasum's dot products, whose summation order is the device's own
 * (fixed, so the same on every run and rank). */
#include <cuda_runtime.h>

#include <stdint.h>

#include "kernels/cuda_pieces.cuh"
#include "kernels/cuda_wire_pieces.cuh"
#include "kernels/gs_kernels.h"

namespace {

constexpr int kThreads = 256;

__global__ void elementwise_kernel(const gs_cu_run_t *runs, const gs_cu_item_t *items, int mode,
                                   double scale) {
  const gs_cu_item_t it = items[blockIdx.x];
  const gs_cu_run_t r = runs[it.run];
  gs_pieces::elementwise_item(mode, r, it.first, it.count, scale, threadIdx.x, blockDim.x);
}

__global__ void nonfinite_kernel(const gs_tensor_t *t, const gs_cu_item_t *items, int *bad) {
  const gs_cu_item_t it = items[blockIdx.x];
  const gs_tensor_t x = t[it.run];
  int found = 0;
  for (int64_t k = threadIdx.x; k < it.count && !found; k += blockDim.x) {
    int64_t i = it.first + k;
    switch (x.dtype) {
      case GS_FLOAT16: found = (((const uint16_t *)x.data)[i] & 0x7c00u) == 0x7c00u; break;
      case GS_BFLOAT16: found = (((const uint16_t *)x.data)[i] & 0x7f80u) == 0x7f80u; break;
      case GS_FLOAT32: found = (((const uint32_t *)x.data)[i] & 0x7f800000u) == 0x7f800000u; break;
      case GS_FLOAT64:
        found = (((const uint64_t *)x.data)[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        break;
      default: break;
    }
  }
  if (__syncthreads_or(found) && threadIdx.x == 0) atomicOr(bad, 1);
}

/* Pass one of the dot products: thread t takes elements t, t + 256, ... in
 * order, then a fixed tree over the block. */
template <int DT>
__device__ void dots_piece(const void *a, const void *b, int64_t first, int64_t count,
                           double acc[3]) {
  typedef typename gs_pieces::Elem<DT>::T T;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    double x = gs_pieces::to_d<DT>(((const T *)a)[first + k]);
    double y = gs_pieces::to_d<DT>(((const T *)b)[first + k]);
    acc[0] += x * y;
    acc[1] += x * x;
    acc[2] += y * y;
  }
}

__global__ void dots_kernel(int dtype, const void *a, const void *b, const gs_cu_slice_t *slices,
                            const gs_cu_item_t *items, double *partial) {
  __shared__ double sh[3][kThreads];
  const gs_cu_item_t it = items[blockIdx.x];
  const int64_t first = slices[it.run].start + it.first;
  double acc[3] = {0.0, 0.0, 0.0};
  switch (dtype) {
    case GS_FLOAT16: dots_piece<GS_FLOAT16>(a, b, first, it.count, acc); break;
    case GS_BFLOAT16: dots_piece<GS_BFLOAT16>(a, b, first, it.count, acc); break;
    case GS_FLOAT32: dots_piece<GS_FLOAT32>(a, b, first, it.count, acc); break;
    default: dots_piece<GS_FLOAT64>(a, b, first, it.count, acc); break;
  }
  for (int c = 0; c < 3; c++) sh[c][threadIdx.x] = acc[c];
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w)
      for (int c = 0; c < 3; c++) sh[c][threadIdx.x] += sh[c][threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    for (int c = 0; c < 3; c++) partial[3 * blockIdx.x + c] = sh[c][0];
}

/* Pass two: slice j sums its items' partials in item order. */
__global__ void dots_finish_kernel(const int64_t *first_item, int64_t n, const double *partial,
                                   double *d) {
  int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  double s[3] = {0.0, 0.0, 0.0};
  for (int64_t k = first_item[j]; k < first_item[j + 1]; k++)
    for (int c = 0; c < 3; c++) s[c] += partial[3 * k + c];
  for (int c = 0; c < 3; c++) d[3 * j + c] = s[c];
}

/* gs_cpu_adasum_combine's arithmetic, element by element. */
template <int DT>
__device__ void combine_piece(double ca, const void *a, double cb, const void *b, void *out,
                              int64_t first, int64_t count) {
  typedef typename gs_pieces::Elem<DT>::T T;
  const bool narrow = DT == GS_FLOAT16 || DT == GS_BFLOAT16;
  const bool in_float =
      narrow && fabs(ca) <= 3.4028234663852886e38 && fabs(cb) <= 3.4028234663852886e38;
  const float fa = (float)ca, fb = (float)cb;
  const T *pa = (const T *)a, *pb = (const T *)b;
  T *po = (T *)out;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    int64_t i = first + k;
    if (in_float)
      po[i] =
          gs_pieces::from_f<DT>(fa * gs_pieces::to_f<DT>(pa[i]) + fb * gs_pieces::to_f<DT>(pb[i]));
    else
      po[i] =
          gs_pieces::from_d<DT>(ca * gs_pieces::to_d<DT>(pa[i]) + cb * gs_pieces::to_d<DT>(pb[i]));
  }
}

__global__ void combine_kernel(int dtype, const void *a, const void *b, void *out,
                               const gs_cu_slice_t *slices, const double *coef,
                               const gs_cu_item_t *items) {
  const gs_cu_item_t it = items[blockIdx.x];
  const int64_t first = slices[it.run].start + it.first;
  const double ca = coef[2 * it.run], cb = coef[2 * it.run + 1];
  switch (dtype) {
    case GS_FLOAT16: combine_piece<GS_FLOAT16>(ca, a, cb, b, out, first, it.count); break;
    case GS_BFLOAT16: combine_piece<GS_BFLOAT16>(ca, a, cb, b, out, first, it.count); break;
    case GS_FLOAT32: combine_piece<GS_FLOAT32>(ca, a, cb, b, out, first, it.count); break;
    default: combine_piece<GS_FLOAT64>(ca, a, cb, b, out, first, it.count); break;
  }
}

__global__ void order_keys_kernel(int dtype, bool max, bool inverse, const void *src, void *dst,
                                  int64_t count) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
       i += (int64_t)gridDim.x * blockDim.x)
    gs_pieces::order_key(dtype, max, inverse, src, dst, i);
}

int launched() { return (int)cudaGetLastError(); }

/* The wire allreduce: each warp takes kBlocksPerWarp blocks of 32 elements
 * in turn (cuda_wire_pieces.cuh); a float8 block's largest magnitude is a
 * max across the warp (exact, so any order gives the host's value). */
constexpr int kWarps = kThreads / 32;
constexpr int kPerWarp = gs_wire_pieces::kBlocksPerWarp;

__device__ inline float warp_max(float m) {
  for (int k = 16; k > 0; k /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, k));
  return m;
}

/* The warp's first block. */
__device__ inline int64_t warp_first_block() {
  return ((int64_t)blockIdx.x * kWarps + threadIdx.x / 32) * kPerWarp;
}

/* A cursor for the lane's elements from e on (clipped to the segment). */
__device__ inline int64_t cursor_at(const gs_cu_wire_job_t &j, int64_t e) {
  return gs_wire_pieces::run_index(j, e < j.n ? e : j.n - 1);
}

__global__ void wire_encode_kernel(gs_cu_wire_job_t j, uint8_t *packed, int64_t nblocks) {
  int64_t b0 = warp_first_block();
  if (b0 >= nblocks) return; /* the whole warp */
  int lane = threadIdx.x % 32;
  gs_wire_pieces::Layout L = gs_wire_pieces::layout(j);
  int64_t cursor = cursor_at(j, b0 * GS_WIRE_BLOCK + lane);
  for (int64_t b = b0; b < b0 + kPerWarp && b < nblocks; b++) {
    float x;
    float m = warp_max(gs_wire_pieces::encode_load(j, b, lane, &cursor, &x));
    gs_wire_pieces::encode_store(j, L, packed, b, lane, cursor, x, m);
  }
}

__global__ void wire_reduce_kernel(gs_cu_wire_job_t j, const uint8_t *recv, uint8_t *packed,
                                   int64_t nblocks) {
  int64_t b0 = warp_first_block();
  if (b0 >= nblocks) return;
  int lane = threadIdx.x % 32;
  gs_wire_pieces::Layout L = gs_wire_pieces::layout(j);
  int64_t first, count;
  gs_wire_layout_shard(&L, j.rank, &first, &count);
  int64_t cursor = j.feedback ? cursor_at(j, first + b0 * GS_WIRE_BLOCK + lane) : 0;
  for (int64_t b = b0; b < b0 + kPerWarp && b < nblocks; b++) {
    float acc;
    float m = warp_max(gs_wire_pieces::reduce_load(j, count, recv, b, lane, &acc));
    gs_wire_pieces::reduce_store(j, L, first, count, packed, b, lane, &cursor, acc, m);
  }
}

__global__ void wire_decode_kernel(gs_cu_wire_job_t j, const uint8_t *gathered, int64_t nblocks) {
  int64_t b0 = warp_first_block();
  if (b0 >= nblocks) return;
  int lane = threadIdx.x % 32;
  gs_wire_pieces::Layout L = gs_wire_pieces::layout(j);
  int64_t cursor = cursor_at(j, b0 * GS_WIRE_BLOCK + lane);
  for (int64_t b = b0; b < b0 + kPerWarp && b < nblocks; b++)
    gs_wire_pieces::decode_lane(j, L, gathered, b, lane, &cursor);
}

/* Grid for `nblocks` wire blocks (segments are at most 2^23 elements, so
 * the grid stays far below its limit). */
inline unsigned wire_grid(int64_t nblocks) {
  return (unsigned)((nblocks + kWarps * kPerWarp - 1) / (kWarps * kPerWarp));
}

inline int64_t wire_blocks(int64_t n) { return (n + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK; }

/* Launches `launch(blocks, first_item)` in chunks of at most 2^31-1 blocks
 * (gridDim.x's limit). */
template <class Launch>
int over_items(int64_t nitems, Launch launch) {
  const int64_t max_grid = 2147483647;
  for (int64_t off = 0; off < nitems; off += max_grid) {
    int64_t blocks = nitems - off < max_grid ? nitems - off : max_grid;
    launch((unsigned)blocks, off);
    int e = launched();
    if (e) return e;
  }
  return 0;
}

}  // namespace

extern "C" int gs_cu_launch_elementwise(int mode, const gs_cu_run_t *runs,
                                        const gs_cu_item_t *items, int64_t nitems, double scale,
                                        void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  return over_items(nitems, [&](unsigned blocks, int64_t off) {
    elementwise_kernel<<<blocks, kThreads, 0, s>>>(runs, items + off, mode, scale);
  });
}

extern "C" int gs_cu_launch_nonfinite(const gs_tensor_t *t, const gs_cu_item_t *items,
                                      int64_t nitems, int *flag, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  return over_items(nitems, [&](unsigned blocks, int64_t off) {
    nonfinite_kernel<<<blocks, kThreads, 0, s>>>(t, items + off, flag);
  });
}

extern "C" int gs_cu_launch_dots(int dtype, const void *a, const void *b,
                                 const gs_cu_slice_t *slices, const gs_cu_item_t *items,
                                 int64_t nitems, const int64_t *first_item, int64_t nslices,
                                 double *partial, double *d, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  int st = over_items(nitems, [&](unsigned blocks, int64_t off) {
    dots_kernel<<<blocks, kThreads, 0, s>>>(dtype, a, b, slices, items + off, partial + 3 * off);
  });
  if (st || nslices == 0) return st;
  unsigned blocks = (unsigned)((nslices + kThreads - 1) / kThreads);
  dots_finish_kernel<<<blocks, kThreads, 0, s>>>(first_item, nslices, partial, d);
  return launched();
}

extern "C" int gs_cu_launch_combine(int dtype, const void *a, const void *b, void *out,
                                    const gs_cu_slice_t *slices, const double *coef,
                                    const gs_cu_item_t *items, int64_t nitems, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  return over_items(nitems, [&](unsigned blocks, int64_t off) {
    combine_kernel<<<blocks, kThreads, 0, s>>>(dtype, a, b, out, slices, coef, items + off);
  });
}

extern "C" int gs_cu_launch_order_keys(int dtype, int max, int inverse, const void *src, void *dst,
                                       int64_t count, void *stream) {
  if (count <= 0) return 0;
  int64_t want = (count + kThreads - 1) / kThreads;
  unsigned blocks = (unsigned)(want < 65535 * 16 ? want : 65535 * 16); /* grid-stride beyond */
  order_keys_kernel<<<blocks, kThreads, 0, (cudaStream_t)stream>>>(dtype, max != 0, inverse != 0,
                                                                   src, dst, count);
  return launched();
}

extern "C" int gs_cu_launch_wire_encode(gs_cu_wire_job_t job, void *packed, void *stream) {
  int64_t nb = wire_blocks(job.n);
  if (nb == 0) return 0;
  wire_encode_kernel<<<wire_grid(nb), kThreads, 0, (cudaStream_t)stream>>>(job, (uint8_t *)packed,
                                                                           nb);
  return launched();
}

extern "C" int gs_cu_launch_wire_reduce(gs_cu_wire_job_t job, const void *recv, void *packed,
                                        void *stream) {
  int64_t first, count;
  gs_wire_shard(job.n, job.p, job.rank, &first, &count);
  int64_t nb = wire_blocks(count);
  if (nb == 0) return 0;
  wire_reduce_kernel<<<wire_grid(nb), kThreads, 0, (cudaStream_t)stream>>>(
      job, (const uint8_t *)recv, (uint8_t *)packed, nb);
  return launched();
}

extern "C" int gs_cu_launch_wire_decode(gs_cu_wire_job_t job, const void *gathered, void *stream) {
  int64_t nb = wire_blocks(job.n);
  if (nb == 0) return 0;
  wire_decode_kernel<<<wire_grid(nb), kThreads, 0, (cudaStream_t)stream>>>(
      job, (const uint8_t *)gathered, nb);
  return launched();
}

extern "C" int gs_cu_load_kernels(void) {
  const void *kernels[] = {(const void *)elementwise_kernel, (const void *)nonfinite_kernel,
                           (const void *)dots_kernel,        (const void *)dots_finish_kernel,
                           (const void *)combine_kernel,     (const void *)order_keys_kernel,
                           (const void *)wire_encode_kernel, (const void *)wire_reduce_kernel,
                           (const void *)wire_decode_kernel};
  for (const void *k : kernels) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}
