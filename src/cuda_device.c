/* Memory on host and CUDA devices, and gradsync's stream per device. In a
 * build without CUDA, host memory works and CUDA requests say so. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gs_cuda.h"
#include "gs_internal.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef GS_CUDA_ARCHS
#define GS_CUDA_ARCHS ""
#endif

#define MAX_DEVICES 64

int gs_cuda_built(void) {
#ifdef GS_HAVE_CUDA
  return 1;
#else
  return 0;
#endif
}

const char *gs_cuda_archs(void) { return GS_CUDA_ARCHS; }

__attribute__((unused)) static gs_status_t no_cuda(const char *what) {
  return gs_fail(GS_ERR_UNSUPPORTED, "%s: this gradsync was built without CUDA (rebuild with "
                 "nvcc on PATH and GRADSYNC_CUDA unset)", what);
}

#ifdef GS_HAVE_CUDA
static gs_status_t cuda_fail(cudaError_t e, const char *what) {
  cudaGetLastError(); /* clear a sticky-free error so the next call starts clean */
  return gs_fail(GS_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define CU_CHECK(call, what)                                    \
  do {                                                          \
    cudaError_t cu_e_ = (call);                                 \
    if (cu_e_ != cudaSuccess) return cuda_fail(cu_e_, (what));  \
  } while (0)

static cudaStream_t streams[MAX_DEVICES];
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
#endif

int gs_cuda_version(void) {
#ifdef GS_HAVE_CUDA
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : CUDART_VERSION;
#else
  return 0;
#endif
}

gs_status_t gs_cuda_device_count(int *count) {
  if (!count) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_device_count: count is NULL");
  *count = 0;
#ifdef GS_HAVE_CUDA
  if (cudaGetDeviceCount(count) != cudaSuccess) { /* no driver or no device: none */
    cudaGetLastError();
    *count = 0;
  }
#endif
  return GS_SUCCESS;
}

gs_status_t gs_cuda_get_device(int *device) {
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_get_device: device is NULL");
#ifdef GS_HAVE_CUDA
  CU_CHECK(cudaGetDevice(device), "gs_cuda_get_device");
  return GS_SUCCESS;
#else
  return no_cuda("gs_cuda_get_device");
#endif
}

gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device) {
  gs_clear_error();
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_pointer_device: device is NULL");
  device->kind = GS_DEVICE_CPU;
  device->id = 0;
#ifdef GS_HAVE_CUDA
  struct cudaPointerAttributes attr;
  if (ptr && cudaPointerGetAttributes(&attr, ptr) == cudaSuccess) {
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      device->kind = GS_DEVICE_CUDA;
      device->id = attr.device;
    } else if (attr.type == cudaMemoryTypeHost) {
      device->kind = GS_DEVICE_CUDA_HOST;
    }
  } else {
    cudaGetLastError(); /* an unregistered host pointer is not an error */
  }
#else
  (void)ptr;
#endif
  return GS_SUCCESS;
}

gs_status_t gs_cu_enter(int device, void **stream, int *previous) {
#ifdef GS_HAVE_CUDA
  if (device < 0 || device >= MAX_DEVICES)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "CUDA device %d is out of range", device);
  CU_CHECK(cudaGetDevice(previous), "gradsync: cudaGetDevice");
  if (*previous != device) CU_CHECK(cudaSetDevice(device), "gradsync: cudaSetDevice");
  pthread_mutex_lock(&streams_lock);
  cudaError_t e = cudaSuccess;
  /* a blocking stream: ordered after the legacy default stream's work */
  if (!streams[device]) e = cudaStreamCreate(&streams[device]);
  cudaStream_t s = streams[device];
  pthread_mutex_unlock(&streams_lock);
  if (e != cudaSuccess) {
    gs_cu_leave(*previous);
    return cuda_fail(e, "gradsync: creating its CUDA stream");
  }
  *stream = s;
  return GS_SUCCESS;
#else
  (void)device; (void)stream; (void)previous;
  return no_cuda("gradsync");
#endif
}

void gs_cu_leave(int previous) {
#ifdef GS_HAVE_CUDA
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous && previous >= 0)
    cudaSetDevice(previous);
#else
  (void)previous;
#endif
}

gs_status_t gs_cu_sync(void *stream, const char *what) {
#ifdef GS_HAVE_CUDA
  CU_CHECK(cudaStreamSynchronize((cudaStream_t)stream), what);
  return GS_SUCCESS;
#else
  (void)stream;
  return no_cuda(what);
#endif
}

gs_status_t gs_cu_copy(void *dst, const void *src, size_t bytes, void *stream) {
#ifdef GS_HAVE_CUDA
  if (bytes)
    CU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream),
             "gradsync: cudaMemcpyAsync");
  return GS_SUCCESS;
#else
  (void)dst; (void)src; (void)bytes; (void)stream;
  return no_cuda("gradsync: device copy");
#endif
}

gs_status_t gs_cu_reserve(void **buf, size_t *have, size_t need, int pinned) {
#ifdef GS_HAVE_CUDA
  if (need <= *have && *buf) return GS_SUCCESS;
  gs_cu_release(*buf, pinned); /* waits for work still using it */
  *buf = NULL;
  *have = 0;
  size_t want = need < 4096 ? 4096 : need;
  cudaError_t e = pinned ? cudaMallocHost(buf, want) : cudaMalloc(buf, want);
  if (e != cudaSuccess) {
    *buf = NULL;
    cudaGetLastError();
    return gs_fail(pinned ? GS_ERR_NO_MEMORY : GS_ERR_CUDA, "gradsync: cannot allocate %zu "
                   "bytes of %s memory: %s", want, pinned ? "pinned host" : "device",
                   cudaGetErrorString(e));
  }
  *have = want;
  return GS_SUCCESS;
#else
  (void)buf; (void)have; (void)need; (void)pinned;
  return no_cuda("gradsync: device buffer");
#endif
}

void gs_cu_release(void *buf, int pinned) {
#ifdef GS_HAVE_CUDA
  if (buf) (void)(pinned ? cudaFreeHost(buf) : cudaFree(buf));
#else
  (void)buf; (void)pinned;
#endif
}

#ifndef GS_HAVE_CUDA
/* Without CUDA no tensor reaches a device path (gs_check_tensors refuses
 * CUDA memory first); these keep the library whole and say so if called. */
gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n,
                              double scale, void *stream) {
  (void)mode; (void)runs; (void)n; (void)scale; (void)stream;
  return no_cuda("gradsync: CUDA kernel");
}
gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *stream) {
  (void)t; (void)n; (void)bad; (void)stream;
  return no_cuda("gradsync: CUDA kernel");
}
gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b,
                              const int64_t *start, const int64_t *count, int64_t n, double *d,
                              void *stream) {
  (void)dtype; (void)a; (void)b; (void)start; (void)count; (void)n; (void)d; (void)stream;
  return no_cuda("gradsync: CUDA kernel");
}
gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count, const double *coef,
                                 int64_t n, void *stream) {
  (void)dtype; (void)a; (void)b; (void)out; (void)start; (void)count; (void)coef; (void)n;
  (void)stream;
  return no_cuda("gradsync: CUDA kernel");
}
#endif

gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr) {
  static const char fn[] = "gs_malloc";
  gs_clear_error();
  if (!ptr) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: ptr is NULL", fn);
  *ptr = NULL;
  switch (device.kind) {
    case GS_DEVICE_CPU:
      if (posix_memalign(ptr, 64, bytes ? bytes : 64) != 0) {
        *ptr = NULL;
        return gs_fail(GS_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes", fn, bytes);
      }
      return GS_SUCCESS;
#ifdef GS_HAVE_CUDA
    case GS_DEVICE_CUDA_HOST: {
      cudaError_t e = cudaMallocHost(ptr, bytes ? bytes : 64);
      if (e != cudaSuccess) return cuda_fail(e, "gs_malloc (pinned host memory)");
      return GS_SUCCESS;
    }
    case GS_DEVICE_CUDA: {
      void *stream;
      int prev;
      GS_CHECK(gs_cu_enter(device.id, &stream, &prev));
      cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 256);
      gs_cu_leave(prev);
      if (e != cudaSuccess) {
        *ptr = NULL;
        return cuda_fail(e, "gs_malloc (CUDA device memory)");
      }
      return GS_SUCCESS;
    }
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA: return no_cuda(fn);
#endif
  }
  return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: unknown device kind %d", fn, (int)device.kind);
}

gs_status_t gs_free(gs_device_t device, void *ptr) {
  gs_clear_error();
  if (!ptr) return GS_SUCCESS;
  switch (device.kind) {
    case GS_DEVICE_CPU: free(ptr); return GS_SUCCESS;
#ifdef GS_HAVE_CUDA
    case GS_DEVICE_CUDA_HOST: CU_CHECK(cudaFreeHost(ptr), "gs_free"); return GS_SUCCESS;
    case GS_DEVICE_CUDA: CU_CHECK(cudaFree(ptr), "gs_free"); return GS_SUCCESS;
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA: return no_cuda("gs_free");
#endif
  }
  return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_free: unknown device kind %d", (int)device.kind);
}

gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src,
                      gs_device_t src_device, size_t bytes) {
  gs_clear_error();
  if (!bytes) return GS_SUCCESS;
  if (!dst || !src) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_memcpy: %s is NULL",
                                   dst ? "src" : "dst");
  if (dst_device.kind != GS_DEVICE_CUDA && src_device.kind != GS_DEVICE_CUDA) {
    memmove(dst, src, bytes);
    return GS_SUCCESS;
  }
#ifdef GS_HAVE_CUDA
  /* unified addressing: the runtime finds the direction and the devices */
  CU_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "gs_memcpy");
  return GS_SUCCESS;
#else
  return no_cuda("gs_memcpy");
#endif
}

gs_status_t gs_cuda_stream(int device, void **stream) {
  gs_clear_error();
  if (!stream) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_stream: stream is NULL");
  int prev;
  GS_CHECK(gs_cu_enter(device, stream, &prev));
  gs_cu_leave(prev);
  return GS_SUCCESS;
}

gs_status_t gs_cuda_order_after(int device, uintptr_t stream) {
  gs_clear_error();
#ifdef GS_HAVE_CUDA
  void *ours;
  int prev;
  GS_CHECK(gs_cu_enter(device, &ours, &prev));
  cudaStream_t theirs = stream == 1   ? cudaStreamLegacy
                        : stream == 2 ? cudaStreamPerThread
                                      : (cudaStream_t)stream;
  gs_status_t s = GS_SUCCESS;
  if (theirs != (cudaStream_t)ours) {
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) {
      e = cudaEventRecord(ev, theirs);
      if (e == cudaSuccess) e = cudaStreamWaitEvent((cudaStream_t)ours, ev, 0);
      cudaEventDestroy(ev); /* the runtime releases it once the wait is over */
    }
    if (e != cudaSuccess) s = cuda_fail(e, "gs_cuda_order_after");
  }
  gs_cu_leave(prev);
  return s;
#else
  (void)device; (void)stream;
  return no_cuda("gs_cuda_order_after");
#endif
}
