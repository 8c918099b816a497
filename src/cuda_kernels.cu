/* The CUDA kernels: gradient control, fusion-buffer packing and Adasum's
 * local math, each over a whole list of tensors in one launch.
 *
 * A list becomes a table of work items (a run and a piece of at most PIECE
 * elements of it), uploaded with the launch; block b does item b. The
 * element arithmetic is half.h's, the code the host kernels run, and the
 * build passes --fmad=false, so every kernel here gives the host's bits
 * except Adasum's dot products, whose summation order is the device's own
 * (fixed, so the same on every run and rank). */
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <stdint.h>
#include <vector>

#include "gs_cuda.h"
#include "half.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kPiece = (int64_t)1 << 14; /* elements per work item */
constexpr int kMaxDevices = 64;

struct Item {
  int64_t run; /* which run (tensor, pair, slice) */
  int64_t first, count;
};

/* ---- the uploaded tables: one device buffer per device, reused in stream
 * order, grown under the lock ------------------------------------------- */

struct Scratch {
  void *dev = nullptr;
  size_t bytes = 0;
};
Scratch g_scratch[kMaxDevices];
std::mutex g_scratch_lock[kMaxDevices];

gs_status_t cuda_fail(cudaError_t e, const char *what) {
  return gs_fail(GS_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CU_CHECK(call, what)                            \
  do {                                                  \
    cudaError_t cu_e_ = (call);                         \
    if (cu_e_ != cudaSuccess) return cuda_fail(cu_e_, (what)); \
  } while (0)

/* Copies `parts` (host memory, any sizes) into this device's scratch, each
 * 256-byte aligned; dev[k] receives where part k landed. The caller holds
 * the device's lock until its launch is queued. */
gs_status_t upload(const std::vector<std::pair<const void *, size_t>> &parts,
                   std::vector<void *> &dev, int device, cudaStream_t stream) {
  size_t total = 0;
  std::vector<size_t> offs;
  for (auto &p : parts) {
    offs.push_back(total);
    total += (p.second + 255) & ~(size_t)255;
  }
  Scratch &s = g_scratch[device];
  if (total > s.bytes) {
    /* cudaFree waits for the kernels still reading the old table */
    if (s.dev) CU_CHECK(cudaFree(s.dev), "gradsync: freeing a kernel table");
    s.dev = nullptr;
    s.bytes = 0;
    size_t want = total < 65536 ? 65536 : total * 2;
    CU_CHECK(cudaMalloc(&s.dev, want), "gradsync: allocating a kernel table");
    s.bytes = want;
  }
  std::vector<char> host(total);
  for (size_t k = 0; k < parts.size(); k++)
    if (parts[k].second) memcpy(host.data() + offs[k], parts[k].first, parts[k].second);
  /* a pageable source: the call returns once `host` has been consumed */
  if (total)
    CU_CHECK(cudaMemcpyAsync(s.dev, host.data(), total, cudaMemcpyHostToDevice, stream),
             "gradsync: uploading a kernel table");
  dev.clear();
  for (size_t k = 0; k < parts.size(); k++) dev.push_back((char *)s.dev + offs[k]);
  return GS_SUCCESS;
}

gs_status_t current_device(int *device) {
  CU_CHECK(cudaGetDevice(device), "gradsync: cudaGetDevice");
  if (*device < 0 || *device >= kMaxDevices)
    return gs_fail(GS_ERR_UNSUPPORTED, "gradsync: CUDA device %d is beyond the %d supported",
                   *device, kMaxDevices);
  return GS_SUCCESS;
}

/* Items covering runs of the given lengths. */
template <class CountOf>
std::vector<Item> work_items(int64_t n, CountOf count_of) {
  std::vector<Item> items;
  for (int64_t r = 0; r < n; r++)
    for (int64_t f = 0; f < count_of(r); f += kPiece)
      items.push_back({r, f, count_of(r) - f < kPiece ? count_of(r) - f : kPiece});
  return items;
}

/* ---- element access: half.h's conversions, by dtype ---------------------- */

template <int DT>
__device__ __forceinline__ float ldf(const void *p, int64_t i) {
  if (DT == GS_FLOAT16) return gs_half_to_float(((const uint16_t *)p)[i]);
  if (DT == GS_BFLOAT16) return gs_bf16_to_float(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

template <int DT>
__device__ __forceinline__ double ldd(const void *p, int64_t i) {
  if (DT == GS_FLOAT64) return ((const double *)p)[i];
  return (double)ldf<DT>(p, i);
}

template <int DT>
__device__ __forceinline__ void stf(void *p, int64_t i, float v) {
  if (DT == GS_FLOAT16) ((uint16_t *)p)[i] = gs_float_to_half(v);
  else if (DT == GS_BFLOAT16) ((uint16_t *)p)[i] = gs_float_to_bf16(v);
  else ((float *)p)[i] = v;
}

template <int DT>
__device__ __forceinline__ void std_(void *p, int64_t i, double v) {
  if (DT == GS_FLOAT16) ((uint16_t *)p)[i] = gs_double_to_half(v);
  else if (DT == GS_BFLOAT16) ((uint16_t *)p)[i] = gs_double_to_bf16(v);
  else if (DT == GS_FLOAT32) ((float *)p)[i] = (float)v;
  else ((double *)p)[i] = v;
}

/* ---- elementwise jobs ------------------------------------------------------- */

/* gs_accumulate's arithmetic: float32, or float64 when either side is. */
template <int ADT, int BDT, bool OVERWRITE>
__device__ void accumulate_piece(const gs_cu_run_t &r, int64_t first, int64_t count) {
  constexpr bool wide = ADT == GS_FLOAT64 || BDT == GS_FLOAT64;
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    int64_t i = first + k;
    if (wide) std_<ADT>(r.a, i, OVERWRITE ? ldd<BDT>(r.b, i) : ldd<ADT>(r.a, i) + ldd<BDT>(r.b, i));
    else stf<ADT>(r.a, i, OVERWRITE ? ldf<BDT>(r.b, i) : ldf<ADT>(r.a, i) + ldf<BDT>(r.b, i));
  }
}

template <bool OVERWRITE>
__device__ void accumulate_dispatch(const gs_cu_run_t &r, int64_t first, int64_t count) {
#define GS_PAIR(A, B) \
  case A * 4 + B: accumulate_piece<A, B, OVERWRITE>(r, first, count); break;
#define GS_ROW(A) GS_PAIR(A, 0) GS_PAIR(A, 1) GS_PAIR(A, 2) GS_PAIR(A, 3)
  switch (r.adtype * 4 + r.bdtype) {
    GS_ROW(0) GS_ROW(1) GS_ROW(2) GS_ROW(3)
    default: break; /* the host checks dtypes before launching */
  }
#undef GS_ROW
#undef GS_PAIR
}

template <class T>
__device__ void copy_bits(const gs_cu_run_t &r, int64_t first, int64_t count) {
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x)
    ((T *)r.a)[first + k] = ((const T *)r.b)[first + k];
}

template <class T>
__device__ void zero_bits(const gs_cu_run_t &r, int64_t first, int64_t count) {
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) ((T *)r.a)[first + k] = T(0);
}

/* gs_cpu_scale_copy's arithmetic: float32 (float64 for float64), once. */
template <int DT>
__device__ void scale_piece(const gs_cu_run_t &r, int64_t first, int64_t count, double scale) {
  const float f = (float)scale;
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    int64_t i = first + k;
    if (DT == GS_FLOAT64) ((double *)r.a)[i] = ((const double *)r.b)[i] * scale;
    else stf<DT>(r.a, i, ldf<DT>(r.b, i) * f);
  }
}

__global__ void elementwise_kernel(const gs_cu_run_t *runs, const Item *items, int mode,
                                   double scale) {
  const Item it = items[blockIdx.x];
  const gs_cu_run_t r = runs[it.run];
  const int es = r.adtype == GS_FLOAT64 || r.adtype == GS_INT64   ? 8
                 : r.adtype == GS_FLOAT32 || r.adtype == GS_INT32 ? 4
                 : r.adtype == GS_INT8 || r.adtype == GS_UINT8    ? 1
                                                                  : 2;
  switch (mode) {
    case GS_CU_ZERO:
      if (es == 8) zero_bits<uint64_t>(r, it.first, it.count);
      else if (es == 4) zero_bits<uint32_t>(r, it.first, it.count);
      else if (es == 2) zero_bits<uint16_t>(r, it.first, it.count);
      else zero_bits<uint8_t>(r, it.first, it.count);
      break;
    case GS_CU_COPY_SCALE:
      if (scale == 1.0 || r.adtype >= GS_INT8) { /* integers are never scaled */
        if (es == 8) copy_bits<uint64_t>(r, it.first, it.count);
        else if (es == 4) copy_bits<uint32_t>(r, it.first, it.count);
        else if (es == 2) copy_bits<uint16_t>(r, it.first, it.count);
        else copy_bits<uint8_t>(r, it.first, it.count);
      } else if (r.adtype == GS_FLOAT16) {
        scale_piece<GS_FLOAT16>(r, it.first, it.count, scale);
      } else if (r.adtype == GS_BFLOAT16) {
        scale_piece<GS_BFLOAT16>(r, it.first, it.count, scale);
      } else if (r.adtype == GS_FLOAT32) {
        scale_piece<GS_FLOAT32>(r, it.first, it.count, scale);
      } else {
        scale_piece<GS_FLOAT64>(r, it.first, it.count, scale);
      }
      break;
    case GS_CU_ACCUMULATE: accumulate_dispatch<false>(r, it.first, it.count); break;
    case GS_CU_OVERWRITE: accumulate_dispatch<true>(r, it.first, it.count); break;
    default: break;
  }
}

/* ---- finiteness ---------------------------------------------------------------- */

__global__ void nonfinite_kernel(const gs_tensor_t *t, const Item *items, int *bad) {
  const Item it = items[blockIdx.x];
  const gs_tensor_t x = t[it.run];
  int found = 0;
  for (int64_t k = threadIdx.x; k < it.count && !found; k += blockDim.x) {
    int64_t i = it.first + k;
    switch (x.dtype) {
      case GS_FLOAT16: found = (((const uint16_t *)x.data)[i] & 0x7c00u) == 0x7c00u; break;
      case GS_BFLOAT16: found = (((const uint16_t *)x.data)[i] & 0x7f80u) == 0x7f80u; break;
      case GS_FLOAT32:
        found = (((const uint32_t *)x.data)[i] & 0x7f800000u) == 0x7f800000u;
        break;
      case GS_FLOAT64:
        found = (((const uint64_t *)x.data)[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        break;
      default: break;
    }
  }
  if (__syncthreads_or(found) && threadIdx.x == 0) atomicOr(bad, 1);
}

/* ---- Adasum ------------------------------------------------------------------- */

struct Slice {
  int64_t start, count;
};

/* Pass one: each item's three partial sums, thread t taking elements
 * t, t + 256, ... in order, then a fixed tree over the block. */
template <int DT>
__device__ void dots_piece(const void *a, const void *b, int64_t first, int64_t count,
                           double acc[3]) {
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    double x = ldd<DT>(a, first + k), y = ldd<DT>(b, first + k);
    acc[0] += x * y;
    acc[1] += x * x;
    acc[2] += y * y;
  }
}

__global__ void dots_kernel(int dtype, const void *a, const void *b, const Slice *slices,
                            const Item *items, double *partial) {
  __shared__ double sh[3][kThreads];
  const Item it = items[blockIdx.x];
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

__device__ bool fits_float(double ca, double cb) {
  return fabs(ca) <= 3.4028234663852886e38 && fabs(cb) <= 3.4028234663852886e38;
}

/* gs_cpu_adasum_combine's arithmetic, element by element. */
template <int DT>
__device__ void combine_piece(double ca, const void *a, double cb, const void *b, void *out,
                              int64_t first, int64_t count) {
  const bool narrow = DT == GS_FLOAT16 || DT == GS_BFLOAT16;
  const bool in_float = narrow && fits_float(ca, cb);
  const float fa = (float)ca, fb = (float)cb;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    int64_t i = first + k;
    if (in_float) stf<DT>(out, i, fa * ldf<DT>(a, i) + fb * ldf<DT>(b, i));
    else std_<DT>(out, i, ca * ldd<DT>(a, i) + cb * ldd<DT>(b, i));
  }
}

__global__ void combine_kernel(int dtype, const void *a, const void *b, void *out,
                               const Slice *slices, const double *coef, const Item *items) {
  const Item it = items[blockIdx.x];
  const int64_t first = slices[it.run].start + it.first;
  const double ca = coef[2 * it.run], cb = coef[2 * it.run + 1];
  switch (dtype) {
    case GS_FLOAT16: combine_piece<GS_FLOAT16>(ca, a, cb, b, out, first, it.count); break;
    case GS_BFLOAT16: combine_piece<GS_BFLOAT16>(ca, a, cb, b, out, first, it.count); break;
    case GS_FLOAT32: combine_piece<GS_FLOAT32>(ca, a, cb, b, out, first, it.count); break;
    default: combine_piece<GS_FLOAT64>(ca, a, cb, b, out, first, it.count); break;
  }
}

/* Launches in chunks of at most 2^31-1 blocks (gridDim.x's limit). */
template <class Launch>
gs_status_t launch_items(size_t nitems, Launch launch, const char *what) {
  const size_t max_grid = 2147483647u;
  for (size_t off = 0; off < nitems; off += max_grid) {
    size_t blocks = nitems - off < max_grid ? nitems - off : max_grid;
    launch((unsigned)blocks, off);
    CU_CHECK(cudaGetLastError(), what);
  }
  return GS_SUCCESS;
}

}  // namespace

extern "C" gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n,
                                         double scale, void *stream_ptr) {
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  std::vector<Item> items = work_items(n, [&](int64_t r) { return runs[r].count; });
  if (items.empty()) return GS_SUCCESS;
  int device;
  gs_status_t s = current_device(&device);
  if (s != GS_SUCCESS) return s;
  std::lock_guard<std::mutex> hold(g_scratch_lock[device]);
  std::vector<void *> dev;
  s = upload({{runs, (size_t)n * sizeof *runs},
                          {items.data(), items.size() * sizeof(Item)}},
                         dev, device, stream);
  if (s != GS_SUCCESS) return s;
  const gs_cu_run_t *druns = (const gs_cu_run_t *)dev[0];
  const Item *ditems = (const Item *)dev[1];
  return launch_items(items.size(), [&](unsigned blocks, size_t off) {
    elementwise_kernel<<<blocks, kThreads, 0, stream>>>(druns, ditems + off, (int)mode, scale);
  }, "gradsync: elementwise kernel launch");
}

extern "C" gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad,
                                       void *stream_ptr) {
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  *bad = 0;
  std::vector<Item> items = work_items(n, [&](int64_t r) {
    return t[r].dtype <= GS_FLOAT64 ? t[r].count : (int64_t)0; /* integers: always finite */
  });
  if (items.empty()) return GS_SUCCESS;
  int device;
  gs_status_t s = current_device(&device);
  if (s != GS_SUCCESS) return s;
  std::unique_lock<std::mutex> hold(g_scratch_lock[device]);
  int zero = 0;
  std::vector<void *> dev;
  s = upload({{&zero, sizeof zero}, {t, (size_t)n * sizeof *t},
              {items.data(), items.size() * sizeof(Item)}},
             dev, device, stream);
  if (s != GS_SUCCESS) return s;
  int *dbad = (int *)dev[0];
  const gs_tensor_t *dt = (const gs_tensor_t *)dev[1];
  const Item *ditems = (const Item *)dev[2];
  s = launch_items(items.size(), [&](unsigned blocks, size_t off) {
    nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(dt, ditems + off, dbad);
  }, "gradsync: all_finite kernel launch");
  if (s != GS_SUCCESS) return s;
  CU_CHECK(cudaMemcpyAsync(bad, dbad, sizeof *bad, cudaMemcpyDeviceToHost, stream),
           "gradsync: reading the all_finite flag");
  CU_CHECK(cudaStreamSynchronize(stream), "gradsync: all_finite kernel");
  return GS_SUCCESS;
}

extern "C" gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b,
                                         const int64_t *start, const int64_t *count, int64_t n,
                                         double *d, void *stream_ptr) {
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  if (n == 0) return GS_SUCCESS;
  std::vector<Slice> slices(n);
  for (int64_t j = 0; j < n; j++) slices[j] = {start[j], count[j]};
  std::vector<Item> items = work_items(n, [&](int64_t j) { return count[j]; });
  std::vector<int64_t> first_item(n + 1, 0);
  for (const Item &it : items) first_item[it.run + 1]++;
  for (int64_t j = 0; j < n; j++) first_item[j + 1] += first_item[j];
  int device;
  gs_status_t s = current_device(&device);
  if (s != GS_SUCCESS) return s;
  std::unique_lock<std::mutex> hold(g_scratch_lock[device]);
  std::vector<double> zeros(3 * (items.size() + n), 0.0);
  std::vector<void *> dev;
  s = upload({{slices.data(), slices.size() * sizeof(Slice)},
              {items.data(), items.size() * sizeof(Item)},
              {first_item.data(), first_item.size() * sizeof(int64_t)},
              {zeros.data(), zeros.size() * sizeof(double)}},
             dev, device, stream);
  if (s != GS_SUCCESS) return s;
  double *partial = (double *)dev[3], *dd = partial + 3 * items.size();
  const Item *ditems = (const Item *)dev[1];
  s = launch_items(items.size(), [&](unsigned blocks, size_t off) {
    dots_kernel<<<blocks, kThreads, 0, stream>>>((int)dtype, a, b, (const Slice *)dev[0],
                                                 ditems + off, partial + 3 * off);
  }, "gradsync: adasum dots kernel launch");
  if (s != GS_SUCCESS) return s;
  unsigned blocks = (unsigned)((n + kThreads - 1) / kThreads);
  dots_finish_kernel<<<blocks, kThreads, 0, stream>>>((const int64_t *)dev[2], n, partial, dd);
  CU_CHECK(cudaGetLastError(), "gradsync: adasum dots kernel launch");
  CU_CHECK(cudaMemcpyAsync(d, dd, 3 * (size_t)n * sizeof(double), cudaMemcpyDeviceToHost,
                           stream), "gradsync: reading adasum dot products");
  CU_CHECK(cudaStreamSynchronize(stream), "gradsync: adasum dots kernel");
  return GS_SUCCESS;
}

extern "C" gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b,
                                            void *out, const int64_t *start,
                                            const int64_t *count, const double *coef, int64_t n,
                                            void *stream_ptr) {
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  std::vector<Slice> slices(n);
  for (int64_t j = 0; j < n; j++) slices[j] = {start[j], count[j]};
  std::vector<Item> items = work_items(n, [&](int64_t j) { return count[j]; });
  if (items.empty()) return GS_SUCCESS;
  int device;
  gs_status_t s = current_device(&device);
  if (s != GS_SUCCESS) return s;
  std::unique_lock<std::mutex> hold(g_scratch_lock[device]);
  std::vector<void *> dev;
  s = upload({{slices.data(), slices.size() * sizeof(Slice)},
              {coef, 2 * (size_t)n * sizeof(double)},
              {items.data(), items.size() * sizeof(Item)}},
             dev, device, stream);
  if (s != GS_SUCCESS) return s;
  const Item *ditems = (const Item *)dev[2];
  return launch_items(items.size(), [&](unsigned blocks, size_t off) {
    combine_kernel<<<blocks, kThreads, 0, stream>>>((int)dtype, a, b, out, (const Slice *)dev[0],
                                                    (const double *)dev[1], ditems + off);
  }, "gradsync: adasum combine kernel launch");
}
