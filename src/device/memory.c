/* Memory on host and CUDA devices. Device memory is stream-ordered
 * (from a pool of gradsync's own per device, kept cached): a buffer
 * is freed in the order of the stream that used it last, so a free never
 * waits for the device and never pulls memory from under queued work.
 * Pinned host memory has no stream order, and cudaFreeHost waits for the
 * whole device (every stream, every library's): gradsync's own pinned
 * buffers are never given back while it runs (a released one is handed out
 * again), and an old one is reused only after the stream that used it is
 * waited for (polling, so with timeouts). The public allocations name
 * their stream (gs_malloc_on; gs_malloc: the legacy default stream):
 * nothing here reads the thread's work stream, which an earlier call may
 * have left naming a stream that is gone by now. gs_memcpy is copy.c's. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "device/gs_cuda.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>

#define MAX_DEVICES 64

/* gradsync's own stream-ordered pool per device, which keeps what is freed
 * (no release threshold), so a steady workload allocates from the pool,
 * not from the driver. Not the device's default pool: its release
 * threshold is shared by every library that allocates from it (CuPy's
 * stream-ordered allocator, any cudaMallocAsync), and raising it would
 * keep their freed memory from the driver too (docs/decisions/gpu.md). */
static cudaMemPool_t pools[MAX_DEVICES];
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;

static cudaMemPool_t own_pool(int device) {
  if (device < 0 || device >= MAX_DEVICES) return NULL;
  pthread_mutex_lock(&pools_lock);
  if (!pools[device]) {
    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = NULL;
    uint64_t keep_all = UINT64_MAX;
    if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
      pools[device] = pool;
    }
    cudaGetLastError(); /* none: the allocation below says why */
  }
  cudaMemPool_t pool = pools[device];
  pthread_mutex_unlock(&pools_lock);
  return pool;
}

gs_status_t gs_cu_malloc_async(void **ptr, size_t bytes, void *stream, const char *what) {
  int device = 0;
  cudaMemPool_t pool = cudaGetDevice(&device) == cudaSuccess ? own_pool(device) : NULL;
  size_t n = bytes ? bytes : 256;
  cudaError_t e = pool ? cudaMallocFromPoolAsync(ptr, n, pool, (cudaStream_t)stream)
                       : cudaMallocAsync(ptr, n, (cudaStream_t)stream);
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

/* gradsync's pinned buffers, in use or spare. cudaFreeHost synchronizes
 * the device, so a free while NCCL kernels of any communicator are in
 * flight (one waiting for a peer that waits for this host) would hang past
 * every timeout: a released buffer becomes a spare instead, handed out
 * again (the smallest that fits), and the process's exit frees them all.
 * Growth is geometric, so the spares add up to less than what is in use at
 * the peak. */
typedef struct pinned_block {
  void *p;
  size_t bytes;
  int spare;
  struct pinned_block *next;
} pinned_block_t;
static pinned_block_t *pinned_blocks;
static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;

/* A spare of at least `need` bytes, taken; NULL if none. */
static pinned_block_t *take_spare(size_t need) {
  pinned_block_t *best = NULL;
  pthread_mutex_lock(&pinned_lock);
  for (pinned_block_t *b = pinned_blocks; b; b = b->next)
    if (b->spare && b->bytes >= need && (!best || b->bytes < best->bytes)) best = b;
  if (best) best->spare = 0;
  pthread_mutex_unlock(&pinned_lock);
  return best;
}

/* A new pinned buffer (cudaMallocHost: the one pinned call that remains on
 * these paths, made only past the high-water mark; docs/RELIABILITY.md). */
static gs_status_t new_pinned(size_t want, void **buf) {
  pinned_block_t *b = malloc(sizeof *b);
  cudaError_t e = b ? cudaMallocHost(buf, want) : cudaErrorMemoryAllocation;
  if (e != cudaSuccess) {
    free(b);
    *buf = NULL;
    cudaGetLastError();
    return gs_fail(GS_ERR_NO_MEMORY,
                   "gradsync: cannot allocate %zu bytes of pinned host memory: %s", want,
                   cudaGetErrorString(e));
  }
  *b = (pinned_block_t){*buf, want, 0, NULL};
  pthread_mutex_lock(&pinned_lock);
  b->next = pinned_blocks;
  pinned_blocks = b;
  pthread_mutex_unlock(&pinned_lock);
  return GS_SUCCESS;
}

gs_status_t gs_cu_grow_pinned(void **buf, size_t *have, size_t need, void *stream) {
  if (need <= *have && *buf) return GS_SUCCESS;
  size_t want = gs_grow_size(*have, need);
  if (*buf) { /* spare once the stream that used it is done with it */
    GS_CHECK(gs_cu_stream_wait(stream, "gradsync: before growing pinned staging memory"));
    gs_cu_release(*buf);
    *buf = NULL;
    *have = 0;
  }
  pinned_block_t *b = take_spare(need);
  if (b) {
    *buf = b->p;
    *have = b->bytes;
    return GS_SUCCESS;
  }
  GS_CHECK(new_pinned(want, buf));
  *have = want;
  return GS_SUCCESS;
}

void gs_cu_release(void *buf) {
  if (!buf) return;
  pthread_mutex_lock(&pinned_lock);
  for (pinned_block_t *b = pinned_blocks; b; b = b->next)
    if (b->p == buf) b->spare = 1;
  pthread_mutex_unlock(&pinned_lock);
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
