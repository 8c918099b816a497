/* Memory on host and CUDA devices. Device memory is stream-ordered
 * (cudaMallocAsync from the device's default pool, kept cached): a buffer
 * is freed in the order of the stream that used it last, so a free never
 * waits for the device and never pulls memory from under queued work. Pinned
 * host memory has no stream order: before an old pinned buffer is freed,
 * the stream that used it is waited for (polling, so with timeouts). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gs_cuda.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>

#define MAX_DEVICES 64

/* The device's default pool keeps what is freed (no release threshold), so
 * a steady workload allocates from the pool, not from the driver. */
static void keep_pool(int device) {
  static int kept[MAX_DEVICES];
  if (device < 0 || device >= MAX_DEVICES || __atomic_load_n(&kept[device], __ATOMIC_ACQUIRE))
    return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep_all = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
  }
  cudaGetLastError();
  __atomic_store_n(&kept[device], 1, __ATOMIC_RELEASE);
}

gs_status_t gs_cu_malloc_async(void **ptr, size_t bytes, void *stream, const char *what) {
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) keep_pool(device);
  cudaError_t e = cudaMallocAsync(ptr, bytes ? bytes : 256, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    *ptr = NULL;
    return gs_cu_fail(e, what);
  }
  return GS_SUCCESS;
}

void gs_cu_free_async(void *ptr, void *stream) {
  if (ptr && cudaFreeAsync(ptr, (cudaStream_t)stream) != cudaSuccess) cudaGetLastError();
}

gs_status_t gs_cu_grow(void **buf, size_t *have, size_t need, void *stream) {
  if (need <= *have && *buf) return GS_SUCCESS;
  size_t want = gs_grow_size(*have, need);
  void *p;
  GS_CHECK(gs_cu_malloc_async(&p, want, stream, "gradsync: growing a device buffer"));
  gs_cu_free_async(*buf, stream); /* after the work queued on it */
  *buf = p;
  *have = want;
  return GS_SUCCESS;
}

gs_status_t gs_cu_grow_pinned(void **buf, size_t *have, size_t need, void *stream) {
  if (need <= *have && *buf) return GS_SUCCESS;
  size_t want = gs_grow_size(*have, need);
  if (*buf) {
    GS_CHECK(gs_cu_stream_wait(stream, "gradsync: before growing pinned staging memory"));
    cudaFreeHost(*buf);
    *buf = NULL;
    *have = 0;
  }
  cudaError_t e = cudaMallocHost(buf, want);
  if (e != cudaSuccess) {
    *buf = NULL;
    cudaGetLastError();
    return gs_fail(GS_ERR_NO_MEMORY,
                   "gradsync: cannot allocate %zu bytes of pinned host "
                   "memory: %s",
                   want, cudaGetErrorString(e));
  }
  *have = want;
  return GS_SUCCESS;
}

void gs_cu_release(void *buf, int pinned) {
  if (!buf) return;
  /* only at communicator free, after its last wait: nothing is queued */
  cudaError_t e = pinned ? cudaFreeHost(buf) : cudaFree(buf);
  if (e != cudaSuccess) cudaGetLastError();
}

gs_status_t gs_cu_copy(void *dst, const void *src, size_t bytes, void *stream) {
  if (!bytes) return GS_SUCCESS;
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream);
  if (e != cudaSuccess) return gs_cu_fail(e, "gradsync: cudaMemcpyAsync");
  return GS_SUCCESS;
}

/* The stream that allocations for `device` go on: the thread's work stream
 * when it belongs to that device, else the device's legacy default stream. */
static void *stream_for(int device) {
  void *s = gs_cu_work_stream();
  if (s == (void *)cudaStreamLegacy || s == (void *)cudaStreamPerThread) return s;
  int on = -1;
  if (cudaStreamGetDevice((cudaStream_t)s, &on) != cudaSuccess) cudaGetLastError();
  return on == device ? s : (void *)cudaStreamLegacy;
}

gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device) {
  gs_clear_error();
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_pointer_device: device is NULL");
  device->kind = GS_DEVICE_CPU;
  device->id = 0;
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
  return GS_SUCCESS;
}

static gs_status_t device_malloc(int device, size_t bytes, void **ptr) {
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  gs_status_t s =
      gs_cu_malloc_async(ptr, bytes, stream_for(device), "gs_malloc (CUDA device memory)");
  gs_cu_leave(&scope);
  return s;
}

static gs_status_t device_free(void *ptr) {
  gs_device_t where;
  GS_CHECK(gs_pointer_device(ptr, &where));
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(where.id, &scope));
  gs_cu_free_async(ptr, stream_for(where.id));
  gs_cu_leave(&scope);
  return GS_SUCCESS;
}

/* Host memory the CUDA runtime does not stage: plain memmove. */
static int host_only(gs_device_t a, gs_device_t b) {
  return a.kind != GS_DEVICE_CUDA && b.kind != GS_DEVICE_CUDA;
}

static gs_status_t device_copy(void *dst, gs_device_t dd, const void *src, gs_device_t sd,
                               size_t bytes) {
  int device = dd.kind == GS_DEVICE_CUDA ? dd.id : sd.id;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  /* synchronous, on the legacy default stream once it follows the thread's
   * work stream: a pageable source is consumed before this returns */
  gs_status_t s = gs_cu_order(cudaStreamLegacy, stream_for(device), "gs_memcpy");
  cudaError_t e = s == GS_SUCCESS ? cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) : cudaSuccess;
  if (e != cudaSuccess) s = gs_cu_fail(e, "gs_memcpy");
  gs_cu_leave(&scope);
  return s;
}

#define ALLOC_HOST_PINNED(ptr, bytes) cudaMallocHost((ptr), (bytes) ? (bytes) : 64)
#define FREE_HOST_PINNED(ptr) cudaFreeHost(ptr)
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
      cudaError_t e = ALLOC_HOST_PINNED(ptr, bytes);
      if (e != cudaSuccess) return gs_cu_fail(e, "gs_malloc (pinned host memory)");
      return GS_SUCCESS;
    }
    case GS_DEVICE_CUDA: return device_malloc(device.id, bytes, ptr);
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA:
      return gs_fail(GS_ERR_UNSUPPORTED, "%s: this gradsync was built without CUDA", fn);
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
    case GS_DEVICE_CUDA_HOST: {
      cudaError_t e = FREE_HOST_PINNED(ptr);
      return e == cudaSuccess ? GS_SUCCESS : gs_cu_fail(e, "gs_free");
    }
    case GS_DEVICE_CUDA: return device_free(ptr);
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA:
      return gs_fail(GS_ERR_UNSUPPORTED, "gs_free: this gradsync was built without CUDA");
#endif
  }
  return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_free: unknown device kind %d", (int)device.kind);
}

gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src, gs_device_t src_device,
                      size_t bytes) {
  gs_clear_error();
  if (!bytes) return GS_SUCCESS;
  if (!dst || !src)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_memcpy: %s is NULL", dst ? "src" : "dst");
#ifdef GS_HAVE_CUDA
  if (!host_only(dst_device, src_device))
    return device_copy(dst, dst_device, src, src_device, bytes);
#else
  if (dst_device.kind == GS_DEVICE_CUDA || src_device.kind == GS_DEVICE_CUDA)
    return gs_fail(GS_ERR_UNSUPPORTED, "gs_memcpy: this gradsync was built without CUDA");
#endif
  memmove(dst, src, bytes);
  return GS_SUCCESS;
}
