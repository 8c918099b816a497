// Emulated CUDA: the kernel launchers of src/kernels/cuda.cu on the host. Each
// launch is queued on its stream (emu_enqueue copies the arguments, as a
// launch does) and runs there later: it reads its tables from emulated
// device memory when it runs, checks every range and alignment it touches
// (a miss is the sticky illegal-address or misaligned-address error), and
// computes with cuda_pieces.cuh's per-thread code, every thread of a block
// in turn, or with the host kernels where the device's summation order is
// its own (Adasum's dot products: compared bitwise with the host path).
#include <stdint.h>
#include <string.h>

extern "C" {
#include "emu.h"
}
#include "kernels/cuda_pieces.cuh"
#include "kernels/cuda_wire_pieces.cuh"
#include "kernels/gs_kernels.h"

extern "C" {
size_t gs_dtype_size(gs_dtype_t dtype);
void gs_cpu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b, int64_t n, double out[3]);
void gs_cpu_adasum_combine(gs_dtype_t dtype, double ca, const void *a, double cb, const void *b,
                           void *out, int64_t n);
}

namespace {

constexpr int kThreads = 256;

size_t esize(int dtype) { return gs_dtype_size((gs_dtype_t)dtype); }

// A device range of `n` elements of `dtype` at element `first` of p.
// `access`: EMU_READ or EMU_WRITE, for the race checks.
cudaError_t check_elems(const void *p, int64_t first, int64_t n, int dtype, int access,
                        const char *what) {
  size_t es = esize(dtype);
  if (n <= 0) return cudaSuccess;
  return emu_check_range((const char *)p + (size_t)first * es, (size_t)n * es, es, 0, access,
                         what);
}

template <class T>
cudaError_t check_table(const T *p, int64_t i, const char *what) {
  return emu_check_range(p + i, sizeof(T), 8, 0, EMU_READ, what);
}

#define TRY(call)                          \
  do {                                     \
    cudaError_t e_ = (call);               \
    if (e_ != cudaSuccess) return e_;      \
  } while (0)

struct Elementwise {
  int mode;
  const gs_cu_run_t *runs;
  const gs_cu_item_t *items;
  int64_t nitems;
  double scale;
};

cudaError_t run_elementwise(void *arg) {
  const Elementwise *k = (const Elementwise *)arg;
  for (int64_t i = 0; i < k->nitems; i++) {
    TRY(check_table(k->items, i, "elementwise kernel: work item"));
    gs_cu_item_t it = k->items[i];
    TRY(check_table(k->runs, it.run, "elementwise kernel: run"));
    gs_cu_run_t r = k->runs[it.run];
    if (k->mode != GS_CU_ZERO && r.b != r.a)
      TRY(check_elems(r.b, it.first, it.count, r.bdtype, EMU_READ, "elementwise kernel: b"));
    TRY(check_elems(r.a, it.first, it.count, r.adtype, EMU_WRITE, "elementwise kernel: a"));
    for (int t = 0; t < kThreads; t++)
      gs_pieces::elementwise_item(k->mode, r, it.first, it.count, k->scale, t, kThreads);
  }
  return cudaSuccess;
}

struct Nonfinite {
  const gs_tensor_t *t;
  const gs_cu_item_t *items;
  int64_t nitems;
  int *flag;
};

bool nonfinite(int dtype, const void *p, int64_t i) {
  switch (dtype) {
    case GS_FLOAT16: return (((const uint16_t *)p)[i] & 0x7c00u) == 0x7c00u;
    case GS_BFLOAT16: return (((const uint16_t *)p)[i] & 0x7f80u) == 0x7f80u;
    case GS_FLOAT32: return (((const uint32_t *)p)[i] & 0x7f800000u) == 0x7f800000u;
    case GS_FLOAT64:
      return (((const uint64_t *)p)[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    default: return false;
  }
}

cudaError_t run_nonfinite(void *arg) {
  const Nonfinite *k = (const Nonfinite *)arg;
  TRY(emu_check_range(k->flag, sizeof(int), sizeof(int), 0, EMU_WRITE, "all_finite kernel: flag"));
  for (int64_t i = 0; i < k->nitems; i++) {
    TRY(check_table(k->items, i, "all_finite kernel: work item"));
    gs_cu_item_t it = k->items[i];
    TRY(check_table(k->t, it.run, "all_finite kernel: tensor"));
    gs_tensor_t x = k->t[it.run];
    TRY(check_elems(x.data, it.first, it.count, x.dtype, EMU_READ,
                    "all_finite kernel: tensor data"));
    for (int64_t j = 0; j < it.count; j++)
      if (nonfinite(x.dtype, x.data, it.first + j)) *k->flag = 1;
  }
  return cudaSuccess;
}

struct Slices {
  int dtype;
  const void *a, *b;
  void *out;
  const gs_cu_slice_t *slices;
  const gs_cu_item_t *items;
  int64_t nitems, nslices;
  const int64_t *first_item;
  const double *coef;
  double *partial, *d;
};

// The slices the items cover, checked; `visit(j, slice)` once per slice.
template <class Visit>
cudaError_t each_slice(const Slices *k, const char *what, Visit visit) {
  int64_t last = -1;
  for (int64_t i = 0; i < k->nitems; i++) {
    TRY(check_table(k->items, i, what));
    gs_cu_item_t it = k->items[i];
    TRY(check_table(k->slices, it.run, what));
    gs_cu_slice_t sl = k->slices[it.run];
    TRY(check_elems(k->a, sl.start + it.first, it.count, k->dtype, EMU_READ, what));
    TRY(check_elems(k->b, sl.start + it.first, it.count, k->dtype, EMU_READ, what));
    if (k->out)
      TRY(check_elems(k->out, sl.start + it.first, it.count, k->dtype, EMU_WRITE, what));
    if (it.run != last) TRY(visit(it.run, sl));
    last = it.run;
  }
  return cudaSuccess;
}

cudaError_t run_dots(void *arg) {
  const Slices *k = (const Slices *)arg;
  TRY(emu_check_range(k->d, 3 * (size_t)k->nslices * sizeof(double), 8, 0, EMU_WRITE,
                      "dots kernel: d"));
  TRY(emu_check_range(k->first_item, ((size_t)k->nslices + 1) * sizeof(int64_t), 8, 0, EMU_READ,
                      "dots kernel: first items"));
  size_t es = esize(k->dtype);
  for (int64_t j = 0; j < k->nslices; j++) k->d[3 * j] = k->d[3 * j + 1] = k->d[3 * j + 2] = 0;
  return each_slice(k, "dots kernel", [&](int64_t j, gs_cu_slice_t sl) {
    gs_cpu_adasum_dots((gs_dtype_t)k->dtype, (const char *)k->a + (size_t)sl.start * es,
                       (const char *)k->b + (size_t)sl.start * es, sl.count, &k->d[3 * j]);
    return cudaSuccess;
  });
}

cudaError_t run_combine(void *arg) {
  const Slices *k = (const Slices *)arg;
  size_t es = esize(k->dtype);
  return each_slice(k, "combine kernel", [&](int64_t j, gs_cu_slice_t sl) {
    TRY(emu_check_range(k->coef + 2 * j, 2 * sizeof(double), 8, 0, EMU_READ,
                        "combine kernel: coef"));
    size_t o = (size_t)sl.start * es;
    gs_cpu_adasum_combine((gs_dtype_t)k->dtype, k->coef[2 * j], (const char *)k->a + o,
                          k->coef[2 * j + 1], (const char *)k->b + o, (char *)k->out + o,
                          sl.count);
    return cudaSuccess;
  });
}

struct Keys {
  int dtype, max, inverse;
  const void *src;
  void *dst;
  int64_t count;
};

cudaError_t run_keys(void *arg) {
  const Keys *k = (const Keys *)arg;
  size_t es = esize(k->dtype), kb = (size_t)gs_cu_key_bytes((gs_dtype_t)k->dtype);
  size_t sb = k->inverse ? kb : es, db = k->inverse ? es : kb;
  TRY(emu_check_range(k->src, (size_t)k->count * sb, sb, 0, EMU_READ, "order-key kernel: src"));
  TRY(emu_check_range(k->dst, (size_t)k->count * db, db, 0, EMU_WRITE, "order-key kernel: dst"));
  for (int64_t i = 0; i < k->count; i++)
    gs_pieces::order_key(k->dtype, k->max != 0, k->inverse != 0, k->src, k->dst, i);
  return cudaSuccess;
}

int queued(cudaError_t e, const char *what) {
  (void)what;
  return (int)e;
}

// The wire allreduce's passes: the lanes of each 32-element block in turn,
// the block's largest magnitude taken between the two steps as the kernel's
// warp shuffle does. Every run, the packing and the residuals are checked
// before anything is touched.
enum WireKind { WIRE_ENCODE, WIRE_REDUCE, WIRE_DECODE };
struct Wire {
  WireKind kind;
  gs_cu_wire_job_t job;
  const uint8_t *src; // recv (reduce) or gathered (decode)
  uint8_t *dst;       // packed (encode, reduce)
};

cudaError_t check_wire_runs(const Wire *k) {
  const gs_cu_wire_job_t &j = k->job;
  int64_t next = 0;
  for (int64_t i = 0; i < j.nruns; i++) {
    TRY(check_table(j.runs, i, "wire kernel: run"));
    const gs_cu_wire_run_t &r = j.runs[i];
    if (r.offset != next || r.count <= 0) return cudaErrorInvalidValue; // the host's contract
    next += r.count;
    if (k->kind == WIRE_ENCODE)
      TRY(check_elems(r.in, 0, r.count, j.dtype, EMU_READ, "wire kernel: input"));
    if (k->kind == WIRE_DECODE)
      TRY(check_elems(r.out, 0, r.count, j.dtype, EMU_WRITE, "wire kernel: output"));
    if (r.residual && k->kind != WIRE_DECODE)
      TRY(check_elems(r.residual, 0, r.count, GS_FLOAT32, EMU_WRITE, "wire kernel: residual"));
  }
  return next == j.n ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t run_wire(void *arg) {
  const Wire *k = (const Wire *)arg;
  const gs_cu_wire_job_t &j = k->job;
  TRY(check_wire_runs(k));
  int64_t first, count, all = gs_wire_shard_bytes(j.wire, j.n);
  gs_wire_shard(j.n, j.p, j.rank, &first, &count);
  int64_t mine = gs_wire_shard_bytes(j.wire, count);
  if (k->kind != WIRE_DECODE)
    TRY(check_elems(k->dst, 0, all, GS_UINT8, EMU_WRITE, "wire kernel: packed shards"));
  if (k->kind != WIRE_ENCODE)
    TRY(check_elems(k->src, 0, k->kind == WIRE_REDUCE ? mine * j.p : all, GS_UINT8, EMU_READ,
                    "wire kernel: received shards"));
  int64_t nb = ((k->kind == WIRE_REDUCE ? count : j.n) + GS_WIRE_BLOCK - 1) / GS_WIRE_BLOCK;
  gs_wire_pieces::Layout L = gs_wire_pieces::layout(j);
  constexpr int kPerWarp = gs_wire_pieces::kBlocksPerWarp;
  for (int64_t b0 = 0; b0 < nb; b0 += kPerWarp) { // one warp: its lanes' cursors
    int64_t cursor[GS_WIRE_BLOCK];
    for (int lane = 0; lane < GS_WIRE_BLOCK; lane++) {
      int64_t e = (k->kind == WIRE_REDUCE ? first : 0) + b0 * GS_WIRE_BLOCK + lane;
      cursor[lane] = gs_wire_pieces::run_index(j, e < j.n ? e : j.n - 1);
    }
    for (int64_t b = b0; b < b0 + kPerWarp && b < nb; b++) {
      float x[GS_WIRE_BLOCK], m = 0.0f;
      for (int lane = 0; lane < GS_WIRE_BLOCK; lane++) {
        if (k->kind == WIRE_ENCODE)
          m = fmaxf(m, gs_wire_pieces::encode_load(j, b, lane, &cursor[lane], &x[lane]));
        if (k->kind == WIRE_REDUCE)
          m = fmaxf(m, gs_wire_pieces::reduce_load(j, count, k->src, b, lane, &x[lane]));
      }
      for (int lane = 0; lane < GS_WIRE_BLOCK; lane++) {
        if (k->kind == WIRE_ENCODE)
          gs_wire_pieces::encode_store(j, L, k->dst, b, lane, cursor[lane], x[lane], m);
        if (k->kind == WIRE_REDUCE)
          gs_wire_pieces::reduce_store(j, L, first, count, k->dst, b, lane, &cursor[lane], x[lane],
                                       m);
        if (k->kind == WIRE_DECODE)
          gs_wire_pieces::decode_lane(j, L, k->src, b, lane, &cursor[lane]);
      }
    }
  }
  return cudaSuccess;
}
// Distinct entry points (the kernel table names each kernel once).
cudaError_t run_wire_encode(void *arg) { return run_wire(arg); }
cudaError_t run_wire_reduce(void *arg) { return run_wire(arg); }
cudaError_t run_wire_decode(void *arg) { return run_wire(arg); }

// ---- module loading --------------------------------------------------------
// Lazy loading, as the runtime does it since CUDA 12.2: a kernel is loaded
// into a device's context by cudaFuncGetAttributes on it, or else at its
// first launch. The counts let a test see that gradsync loads every kernel,
// once per device, before it queues NCCL work there (a lazy load while
// NCCL kernels spin can wait for them forever, so the emulation counts
// NCCL launches made on a device with a kernel not loaded yet, and kernel
// loads made lazily on a device where NCCL work was already queued).
constexpr int kMaxDevices = 8;
const void *const kKernels[] = {(const void *)run_elementwise, (const void *)run_nonfinite,
                                (const void *)run_dots, (const void *)run_combine,
                                (const void *)run_keys, (const void *)run_wire_encode,
                                (const void *)run_wire_reduce, (const void *)run_wire_decode};
constexpr int kKernelCount = (int)(sizeof kKernels / sizeof *kKernels);
enum { K_ELEMENTWISE, K_NONFINITE, K_DOTS, K_COMBINE, K_KEYS, K_WIRE_ENCODE, K_WIRE_REDUCE,
       K_WIRE_DECODE };
long loads[kMaxDevices][kKernelCount]; // explicit loads (atomics)
int lazy[kMaxDevices][kKernelCount];   // loaded by a launch
int nccl_seen[kMaxDevices];            // NCCL work queued on the device
long unloaded_at_nccl, lazy_after_nccl;

int kernel_index(const void *fn) {
  for (int i = 0; i < kKernelCount; i++)
    if (kKernels[i] == fn) return i;
  return -1;
}

bool loaded(int device, int k) {
  return __atomic_load_n(&loads[device][k], __ATOMIC_SEQ_CST) > 0 ||
         __atomic_load_n(&lazy[device][k], __ATOMIC_SEQ_CST);
}

// A launch of kernel k on the current device: a lazy load if nobody loaded it.
void launching(int k) {
  int device = emu_current_device();
  if (device < 0 || device >= kMaxDevices || loaded(device, k)) return;
  if (__atomic_exchange_n(&lazy[device][k], 1, __ATOMIC_SEQ_CST)) return;
  if (__atomic_load_n(&nccl_seen[device], __ATOMIC_SEQ_CST))
    __atomic_add_fetch(&lazy_after_nccl, 1, __ATOMIC_SEQ_CST);
}

}  // namespace

#define HOOK __attribute__((visibility("default")))

extern "C" cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attr, const void *fn) {
  int k = kernel_index(fn), device = emu_current_device();
  if (device < 0) return emu_sticky();
  if (k < 0 || !attr || device >= kMaxDevices) return cudaErrorInvalidDeviceFunction;
  memset(attr, 0, sizeof *attr);
  attr->maxThreadsPerBlock = 1024;
  __atomic_add_fetch(&loads[device][k], 1, __ATOMIC_SEQ_CST);
  return cudaSuccess;
}

extern "C" int gs_cu_load_kernels(void) {
  cudaFuncAttributes attr;
  for (const void *k : kKernels) {
    cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

// NCCL work about to be queued on the current device (emu_nccl.c).
extern "C" void emu_nccl_launching(void) {
  int device = emu_current_device();
  if (device < 0 || device >= kMaxDevices) return;
  __atomic_store_n(&nccl_seen[device], 1, __ATOMIC_SEQ_CST);
  for (int k = 0; k < kKernelCount; k++)
    if (!loaded(device, k)) {
      __atomic_add_fetch(&unloaded_at_nccl, 1, __ATOMIC_SEQ_CST);
      return;
    }
}

// Test hooks: how many kernels there are; explicit loads of kernel k on
// `device`; NCCL launches made while a kernel of their device was not
// loaded; kernels loaded lazily, by their first launch, after NCCL work.
extern "C" HOOK int gs_emulated_kernel_count(void) { return kKernelCount; }
extern "C" HOOK long gs_emulated_kernel_loads(int device, int k) {
  if (device < 0 || device >= kMaxDevices || k < 0 || k >= kKernelCount) return -1;
  return __atomic_load_n(&loads[device][k], __ATOMIC_SEQ_CST);
}
extern "C" HOOK long gs_emulated_unloaded_at_nccl(void) {
  return __atomic_load_n(&unloaded_at_nccl, __ATOMIC_SEQ_CST);
}
extern "C" HOOK long gs_emulated_lazy_after_nccl(void) {
  return __atomic_load_n(&lazy_after_nccl, __ATOMIC_SEQ_CST);
}

extern "C" int gs_cu_launch_elementwise(int mode, const gs_cu_run_t *runs,
                                                const gs_cu_item_t *items, int64_t nitems,
                                                double scale, void *stream) {
  launching(K_ELEMENTWISE);
  Elementwise k = {mode, runs, items, nitems, scale};
  return queued(emu_enqueue((cudaStream_t)stream, run_elementwise, &k, sizeof k),
                "gradsync: elementwise kernel launch");
}

extern "C" int gs_cu_launch_nonfinite(const gs_tensor_t *t, const gs_cu_item_t *items,
                                              int64_t nitems, int *flag, void *stream) {
  launching(K_NONFINITE);
  Nonfinite k = {t, items, nitems, flag};
  return queued(emu_enqueue((cudaStream_t)stream, run_nonfinite, &k, sizeof k),
                "gradsync: all_finite kernel launch");
}

extern "C" int gs_cu_launch_dots(int dtype, const void *a, const void *b,
                                         const gs_cu_slice_t *slices, const gs_cu_item_t *items,
                                         int64_t nitems, const int64_t *first_item,
                                         int64_t nslices, double *partial, double *d,
                                         void *stream) {
  launching(K_DOTS);
  Slices k = {dtype, a, b, nullptr, slices, items, nitems, nslices, first_item, nullptr,
              partial, d};
  return queued(emu_enqueue((cudaStream_t)stream, run_dots, &k, sizeof k),
                "gradsync: adasum dots kernel launch");
}

extern "C" int gs_cu_launch_combine(int dtype, const void *a, const void *b, void *out,
                                            const gs_cu_slice_t *slices, const double *coef,
                                            const gs_cu_item_t *items, int64_t nitems,
                                            void *stream) {
  launching(K_COMBINE);
  Slices k = {dtype, a, b, out, slices, items, nitems, 0, nullptr, coef, nullptr, nullptr};
  return queued(emu_enqueue((cudaStream_t)stream, run_combine, &k, sizeof k),
                "gradsync: adasum combine kernel launch");
}

extern "C" int gs_cu_launch_order_keys(int dtype, int max, int inverse, const void *src,
                                               void *dst, int64_t count, void *stream) {
  if (count <= 0) return 0;
  launching(K_KEYS);
  Keys k = {dtype, max, inverse, src, dst, count};
  return queued(emu_enqueue((cudaStream_t)stream, run_keys, &k, sizeof k),
                "gradsync: min/max order-key kernel launch");
}

static int queue_wire(int kernel, cudaError_t (*fn)(void *), const Wire &k, void *stream,
                      const char *what) {
  launching(kernel);
  return queued(emu_enqueue((cudaStream_t)stream, fn, &k, sizeof k), what);
}

extern "C" int gs_cu_launch_wire_encode(gs_cu_wire_job_t job, void *packed, void *stream) {
  if (job.n == 0) return 0;
  Wire k = {WIRE_ENCODE, job, NULL, (uint8_t *)packed};
  return queue_wire(K_WIRE_ENCODE, run_wire_encode, k, stream, "gradsync: wire encode launch");
}

extern "C" int gs_cu_launch_wire_reduce(gs_cu_wire_job_t job, const void *recv, void *packed,
                                        void *stream) {
  int64_t first, count;
  gs_wire_shard(job.n, job.p, job.rank, &first, &count);
  if (count == 0) return 0;
  Wire k = {WIRE_REDUCE, job, (const uint8_t *)recv, (uint8_t *)packed};
  return queue_wire(K_WIRE_REDUCE, run_wire_reduce, k, stream, "gradsync: wire reduce launch");
}

extern "C" int gs_cu_launch_wire_decode(gs_cu_wire_job_t job, const void *gathered, void *stream) {
  if (job.n == 0) return 0;
  Wire k = {WIRE_DECODE, job, (const uint8_t *)gathered, NULL};
  return queue_wire(K_WIRE_DECODE, run_wire_decode, k, stream, "gradsync: wire decode launch");
}
