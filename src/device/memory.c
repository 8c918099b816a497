/* Memory on host and CUDA devices. Device memory is stream-ordered
 * (cudaMallocAsync from the device's default pool, kept cached): a buffer
 * is freed in the order of the stream that used it last, so a free never
 * waits for the device and never pulls memory from under queued work. Pinned
 * host memory has no stream order: before an old pinned buffer is freed,
 * the stream that used it is waited for (polling, so with timeouts). The
 * public allocations name their stream (gs_malloc_on; gs_malloc: the legacy
 * default stream): nothing here reads the thread's work stream, which an
 * earlier call may have left naming a stream that is gone by now. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "device/gs_cuda.h"

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

gs_status_t gs_pointer_device(const void *ptr, gs_device_t *device) {
  gs_clear_error();
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_pointer_device: device is NULL");
  device->kind = GS_DEVICE_CPU;
  device->id = 0;
  /* in a context the process has: with none at all, no memory is CUDA's
   * (and the query must not create one on the current device) */
  gs_cu_scope_t scope;
  int none = 1;
  if (!ptr) return GS_SUCCESS;
  if (gs_cu_enter_existing(&scope, &none) != GS_SUCCESS) {
    gs_clear_error();
    return GS_SUCCESS;
  }
  struct cudaPointerAttributes attr;
  if (!none && cudaPointerGetAttributes(&attr, ptr) == cudaSuccess) {
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      device->kind = GS_DEVICE_CUDA;
      device->id = attr.device;
    } else if (attr.type == cudaMemoryTypeHost) {
      device->kind = GS_DEVICE_CUDA_HOST;
    }
  } else if (!none) {
    cudaGetLastError(); /* an unregistered host pointer is not an error */
  }
  gs_cu_leave(&scope);
  return GS_SUCCESS;
}

static gs_status_t device_malloc(int device, size_t bytes, uintptr_t stream, void **ptr) {
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  gs_status_t s =
      gs_cu_malloc_async(ptr, bytes, gs_cu_as_stream(stream), "gs_malloc (CUDA device memory)");
  gs_cu_leave(&scope);
  return s;
}

static gs_status_t device_free(void *ptr, uintptr_t stream) {
  gs_device_t where;
  GS_CHECK(gs_pointer_device(ptr, &where));
  if (where.kind != GS_DEVICE_CUDA)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_free: %p is not CUDA device memory", ptr);
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(where.id, &scope));
  cudaError_t e = cudaFreeAsync(ptr, (cudaStream_t)gs_cu_as_stream(stream));
  gs_cu_leave(&scope);
  return e == cudaSuccess ? GS_SUCCESS : gs_cu_fail(e, "gs_free (CUDA device memory)");
}

/* Pinned memory belongs to a context: the thread's, or one the process
 * has, else (the first CUDA memory of a process) the current device's.
 * Portable, so that every context sees it pinned. */
static gs_status_t pinned_malloc(size_t bytes, void **ptr) {
  gs_cu_scope_t scope;
  int none = 0, device = 0;
  GS_CHECK(gs_cu_enter_existing(&scope, &none));
  if (none) GS_CHECK(gs_cuda_get_device(&device));
  if (none) GS_CHECK(gs_cu_enter(device, &scope));
  cudaError_t e = cudaHostAlloc(ptr, bytes ? bytes : 64, cudaHostAllocPortable);
  gs_cu_leave(&scope);
  if (e != cudaSuccess) {
    *ptr = NULL;
    return gs_cu_fail(e, "gs_malloc (pinned host memory)");
  }
  return GS_SUCCESS;
}

static gs_status_t pinned_free(void *ptr) {
  gs_cu_scope_t scope;
  int none = 0;
  GS_CHECK(gs_cu_enter_existing(&scope, &none));
  if (none) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_free: %p is not pinned memory", ptr);
  cudaError_t e = cudaFreeHost(ptr);
  gs_cu_leave(&scope);
  return e == cudaSuccess ? GS_SUCCESS : gs_cu_fail(e, "gs_free (pinned host memory)");
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
  /* on the legacy default stream once it follows the thread's work stream
   * (this call's: the caller set it), which then follows the copy: host
   * memory is consumed or filled before this returns, a device destination
   * may still be written after, in those streams' order */
  void *work = gs_cu_work_stream();
  gs_status_t s = gs_cu_order(cudaStreamLegacy, work, "gs_memcpy");
  cudaError_t e = s == GS_SUCCESS ? cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) : cudaSuccess;
  if (e != cudaSuccess) s = gs_cu_fail(e, "gs_memcpy");
  if (s == GS_SUCCESS) s = gs_cu_order(work, cudaStreamLegacy, "gs_memcpy");
  gs_cu_leave(&scope);
  return s;
}
#endif

gs_status_t gs_malloc_on(gs_device_t device, size_t bytes, uintptr_t stream, void **ptr) {
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
    case GS_DEVICE_CUDA_HOST: return pinned_malloc(bytes, ptr);
    case GS_DEVICE_CUDA: return device_malloc(device.id, bytes, stream, ptr);
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA:
      return gs_fail(GS_ERR_UNSUPPORTED, "%s: this gradsync was built without CUDA", fn);
#endif
  }
  return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: unknown device kind %d", fn, (int)device.kind);
}

gs_status_t gs_free_on(gs_device_t device, void *ptr, uintptr_t stream) {
  gs_clear_error();
  if (!ptr) return GS_SUCCESS;
  switch (device.kind) {
    case GS_DEVICE_CPU: free(ptr); return GS_SUCCESS;
#ifdef GS_HAVE_CUDA
    case GS_DEVICE_CUDA_HOST: return pinned_free(ptr);
    case GS_DEVICE_CUDA: return device_free(ptr, stream);
#else
    case GS_DEVICE_CUDA_HOST:
    case GS_DEVICE_CUDA:
      return gs_fail(GS_ERR_UNSUPPORTED, "gs_free: this gradsync was built without CUDA");
#endif
  }
  return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_free: unknown device kind %d", (int)device.kind);
}

gs_status_t gs_malloc(gs_device_t device, size_t bytes, void **ptr) {
  return gs_malloc_on(device, bytes, 1, ptr); /* the legacy default stream */
}

gs_status_t gs_free(gs_device_t device, void *ptr) { return gs_free_on(device, ptr, 1); }

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
