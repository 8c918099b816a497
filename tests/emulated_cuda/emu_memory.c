/* Emulated CUDA: devices, contexts, memory, copies and errors (see emu.h). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

#include "emu.h"

#define MAX_DEVICES 8
#define QUARANTINE_BYTES ((size_t)256 << 20)
#define POISON 0xa5

/* ---- devices and contexts -------------------------------------------------- */

static int device_count(void) {
  const char *s = getenv("GS_EMU_DEVICES");
  int n = s && *s ? atoi(s) : 2;
  return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static int driver_version(void) {
  const char *s = getenv("GS_EMU_DRIVER_VERSION");
  return s && *s ? atoi(s) : 13000;
}

static int primary_created[MAX_DEVICES];
static char context_tokens[MAX_DEVICES];
static _Thread_local int stack[16], depth;   /* contexts pushed through the driver */
static _Thread_local int runtime_device = -1; /* cudaSetDevice's, or implicit */
static _Thread_local cudaError_t last_error;

/* Test hook: whether `device`'s primary context was ever created. */
__attribute__((visibility("default"))) int gs_emulated_context_created(int device) {
  return device >= 0 && device < MAX_DEVICES && __atomic_load_n(&primary_created[device], 0);
}

int emu_current_device(void) {
  if (emu_sticky() != cudaSuccess) return -1;
  if (depth > 0) return stack[depth - 1];
  if (runtime_device < 0) { /* the runtime initializes device 0, as CUDA does */
    runtime_device = 0;
    __atomic_store_n(&primary_created[0], 1, 0);
  }
  return runtime_device;
}

static cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

cudaError_t cudaGetDeviceCount(int *count) {
  if (driver_version() < 13000) {
    *count = 0;
    return fail(cudaErrorInsufficientDriver);
  }
  *count = device_count();
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) {
  *v = driver_version();
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  /* no context is created: an unset thread reports device 0 */
  *device = depth > 0 ? stack[depth - 1] : runtime_device < 0 ? 0 : runtime_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  runtime_device = device;
  __atomic_store_n(&primary_created[device], 1, 0);
  if (depth > 0) stack[depth - 1] = device; /* it replaces the current context */
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = emu_sticky();
  if (e == cudaSuccess) e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  cudaError_t e = emu_sticky();
  return e != cudaSuccess ? e : last_error;
}

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    default: return "cudaErrorEmulated";
  }
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMemoryAllocation: return "out of memory";
    default: return "emulated error";
  }
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "gradsync emulated device %d", device);
  prop->uuid.bytes[0] = (char)(device + 1);
  const char *distinct = getenv("GS_EMU_DISTINCT_GPUS");
  if (distinct && strcmp(distinct, "1") == 0) { /* one GPU per process: NCCL allowed */
    pid_t pid = getpid();
    memcpy(prop->uuid.bytes + 4, &pid, sizeof pid);
  }
  prop->multiProcessorCount = 4;
  return cudaSuccess;
}

/* The driver entry points gradsync asks the runtime for. */
static CUresult drv_retain(CUcontext *ctx, CUdevice dev) {
  if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  __atomic_store_n(&primary_created[dev], 1, 0);
  *ctx = (CUcontext)&context_tokens[dev];
  return CUDA_SUCCESS;
}
static CUresult drv_release(CUdevice dev) {
  (void)dev;
  return CUDA_SUCCESS;
}
static CUresult drv_push(CUcontext ctx) {
  if (depth >= 16) return CUDA_ERROR_INVALID_VALUE;
  stack[depth++] = (int)((char *)ctx - context_tokens);
  return CUDA_SUCCESS;
}
static CUresult drv_pop(CUcontext *ctx) {
  if (depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  int d = stack[--depth];
  if (ctx) *ctx = (CUcontext)&context_tokens[d];
  return CUDA_SUCCESS;
}
static CUresult drv_state(CUdevice dev, unsigned int *flags, int *active) {
  if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = __atomic_load_n(&primary_created[dev], 0);
  return CUDA_SUCCESS;
}
static CUresult drv_current(CUcontext *ctx) {
  *ctx = depth > 0 ? (CUcontext)&context_tokens[stack[depth - 1]]
         : runtime_device >= 0 ? (CUcontext)&context_tokens[runtime_device] : NULL;
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
  (void)version; (void)flags;
  static const struct { const char *name; void *fn; } table[] = {
      {"cuDevicePrimaryCtxRetain", (void *)drv_retain},
      {"cuDevicePrimaryCtxRelease", (void *)drv_release},
      {"cuCtxPushCurrent", (void *)drv_push},
      {"cuCtxPopCurrent", (void *)drv_pop},
      {"cuCtxGetCurrent", (void *)drv_current},
      {"cuDevicePrimaryCtxGetState", (void *)drv_state},
  };
  *fn = NULL;
  for (size_t k = 0; k < sizeof table / sizeof *table; k++)
    if (strcmp(symbol, table[k].name) == 0) *fn = table[k].fn;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

/* ---- the allocation table ---------------------------------------------------- */

typedef struct alloc {
  char *base;
  size_t bytes;
  enum cudaMemoryType type;
  int device;
  emu_accesses_t *acc; /* stream work's accesses (emu_races.c) */
} alloc_t;

static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static alloc_t *allocs;
static size_t nallocs, cap_allocs;
static void **quarantine;
static size_t *quarantine_bytes, nquarantine, quarantine_total;
static long pageable_uploads;
static int hold_uploads;

/* Test hook: the next host-to-device copy's DMA (cudaMemcpy from pageable
 * memory, or any cudaMemcpyAsync from host memory) waits behind a gate
 * (gs_emulated_release): it is still queued when the call returns, as it
 * may be on hardware. */
__attribute__((visibility("default"))) void gs_emulated_hold_uploads(void) {
  __atomic_store_n(&hold_uploads, 1, 0);
}

/* Test hook: host-to-device copies from pageable memory seen so far. */
__attribute__((visibility("default"))) long gs_emulated_pageable_uploads(void) { return __atomic_load_n(&pageable_uploads, 0); }

/* Index of the allocation holding p, or -1 (under mem_mu). */
static long find(const void *p) {
  size_t lo = 0, hi = nallocs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if ((const char *)p < allocs[mid].base) hi = mid;
    else if ((const char *)p >= allocs[mid].base + allocs[mid].bytes) lo = mid + 1;
    else return (long)mid;
  }
  return -1;
}

static cudaError_t track(void *p, size_t bytes, enum cudaMemoryType type, int device) {
  pthread_mutex_lock(&mem_mu);
  if (nallocs == cap_allocs) {
    size_t cap = cap_allocs ? 2 * cap_allocs : 256;
    alloc_t *n = realloc(allocs, cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&mem_mu);
      return cudaErrorMemoryAllocation;
    }
    allocs = n;
    cap_allocs = cap;
  }
  size_t at = 0;
  while (at < nallocs && allocs[at].base < (char *)p) at++;
  memmove(&allocs[at + 1], &allocs[at], (nallocs - at) * sizeof *allocs);
  allocs[at] = (alloc_t){p, bytes, type, device, NULL};
  nallocs++;
  pthread_mutex_unlock(&mem_mu);
  return cudaSuccess;
}

static cudaError_t emu_alloc(void **p, size_t bytes, enum cudaMemoryType type) {
  int device = emu_current_device();
  if (device < 0) return emu_sticky();
  void *m = NULL;
  if (posix_memalign(&m, 256, bytes ? bytes : 1) != 0) return fail(cudaErrorMemoryAllocation);
  memset(m, POISON, bytes); /* uninitialised device memory is not zero */
  cudaError_t e = track(m, bytes ? bytes : 1, type, device);
  if (e != cudaSuccess) {
    free(m);
    return fail(e);
  }
  *p = m;
  return cudaSuccess;
}

/* Poisons and quarantines: later use finds no live allocation there. A
 * stream-ordered free (`ordered`) must also be ordered after every use. */
static cudaError_t emu_release(void *p, enum cudaMemoryType type, int ordered) {
  if (!p) return cudaSuccess;
  pthread_mutex_lock(&mem_mu);
  long i = find(p);
  if (i < 0 || allocs[i].base != p || allocs[i].type != type) {
    pthread_mutex_unlock(&mem_mu);
    fprintf(stderr, "emulated CUDA: free of %p, which is not a live %s allocation\n", p,
            type == cudaMemoryTypeHost ? "pinned" : "device");
    return fail(cudaErrorInvalidValue);
  }
  if (ordered && emu_races_free(&allocs[i].acc, p, "cudaFreeAsync") != 0) {
    pthread_mutex_unlock(&mem_mu);
    return cudaErrorIllegalAddress;
  }
  emu_races_drop(&allocs[i].acc);
  size_t bytes = allocs[i].bytes;
  memmove(&allocs[i], &allocs[i + 1], (nallocs - (size_t)i - 1) * sizeof *allocs);
  nallocs--;
  memset(p, POISON, bytes);
  void **q = realloc(quarantine, (nquarantine + 1) * sizeof *q);
  size_t *qb = q ? realloc(quarantine_bytes, (nquarantine + 1) * sizeof *qb) : NULL;
  if (q) quarantine = q;
  if (qb) quarantine_bytes = qb;
  if (q && qb) {
    quarantine[nquarantine] = p;
    quarantine_bytes[nquarantine++] = bytes;
    quarantine_total += bytes;
  } else {
    free(p);
  }
  while (quarantine_total > QUARANTINE_BYTES && nquarantine) {
    free(quarantine[0]);
    quarantine_total -= quarantine_bytes[0];
    memmove(quarantine, quarantine + 1, --nquarantine * sizeof *quarantine);
    memmove(quarantine_bytes, quarantine_bytes + 1, nquarantine * sizeof *quarantine_bytes);
  }
  pthread_mutex_unlock(&mem_mu);
  return cudaSuccess;
}

cudaError_t emu_check_range(const void *p, size_t bytes, size_t align, int host_ok, int access,
                            const char *what) {
  if (bytes == 0) return cudaSuccess;
  if (align > 1 && (uintptr_t)p % align) {
    fprintf(stderr, "emulated CUDA: %s: address %p is not aligned to %zu bytes\n", what, p,
            align);
    return cudaErrorMisalignedAddress;
  }
  pthread_mutex_lock(&mem_mu);
  long i = find(p);
  int ok = i >= 0 ? (const char *)p + bytes <= allocs[i].base + allocs[i].bytes : host_ok;
  int raced = ok && i >= 0 && access != EMU_TOUCH &&
              emu_races_access(&allocs[i].acc, p, (const char *)p + bytes, access == EMU_WRITE,
                               what) != 0;
  pthread_mutex_unlock(&mem_mu);
  if (raced) return cudaErrorIllegalAddress;
  if (!ok) {
    fprintf(stderr, "emulated CUDA: %s: [%p, +%zu) is not inside live device memory (freed, "
            "out of bounds, or host memory)\n", what, p, bytes);
    return cudaErrorIllegalAddress;
  }
  return cudaSuccess;
}

/* The kind of memory at p: unregistered (pageable host memory) unless tracked. */
static enum cudaMemoryType kind_of(const void *p) {
  pthread_mutex_lock(&mem_mu);
  long i = find(p);
  enum cudaMemoryType t = i >= 0 ? allocs[i].type : cudaMemoryTypeUnregistered;
  pthread_mutex_unlock(&mem_mu);
  return t;
}

static int is_tracked(const void *p) { return kind_of(p) != cudaMemoryTypeUnregistered; }

/* Test hook: reads device memory now, from the host, outside any stream's
 * order (what a test looks at without taking part in the race checks).
 * 0, or -1 when [src, +bytes) is not inside one live allocation. */
__attribute__((visibility("default"))) int gs_emulated_peek(void *dst, const void *src,
                                                            size_t bytes) {
  pthread_mutex_lock(&mem_mu);
  long i = find(src);
  int ok = i >= 0 && (const char *)src + bytes <= allocs[i].base + allocs[i].bytes;
  if (ok) memcpy(dst, src, bytes);
  pthread_mutex_unlock(&mem_mu);
  return ok ? 0 : -1;
}

/* Calls that need a context create the current device's primary context
 * when the thread has none, as the runtime does. */
cudaError_t cudaMalloc(void **p, size_t n) { return emu_alloc(p, n, cudaMemoryTypeDevice); }
cudaError_t cudaMallocHost(void **p, size_t n) { return emu_alloc(p, n, cudaMemoryTypeHost); }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags) {
  (void)flags;
  return emu_alloc(p, n, cudaMemoryTypeHost);
}
cudaError_t cudaFree(void *p) {
  emu_blocking_call("cudaFree");
  return emu_release(p, cudaMemoryTypeDevice, 0);
}
cudaError_t cudaFreeHost(void *p) {
  if (emu_current_device() < 0) return emu_sticky();
  emu_blocking_call("cudaFreeHost");
  return emu_release(p, cudaMemoryTypeHost, 0);
}

/* Stream-ordered: the allocation is born at the stream's position now, and
 * work on other streams must be ordered after that (emu_races.c). */
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t stream) {
  cudaError_t e = emu_alloc(p, n, cudaMemoryTypeDevice);
  emu_point_t at;
  if (e == cudaSuccess && emu_mark(stream, &at) == cudaSuccess) {
    pthread_mutex_lock(&mem_mu);
    long i = find(*p);
    if (i >= 0) emu_races_born(&allocs[i].acc, allocs[i].base, allocs[i].base + allocs[i].bytes, at);
    pthread_mutex_unlock(&mem_mu);
  }
  return e;
}

static cudaError_t free_later(void *arg) {
  return emu_release(*(void **)arg, cudaMemoryTypeDevice, 1);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t stream) {
  if (!p) return cudaSuccess;
  return emu_enqueue(stream, free_later, &p, sizeof p);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr) {
  memset(attr, 0, sizeof *attr);
  if (emu_current_device() < 0) return emu_sticky();
  attr->type = cudaMemoryTypeUnregistered;
  attr->device = 0;
  pthread_mutex_lock(&mem_mu);
  long i = ptr ? find(ptr) : -1;
  if (i >= 0) {
    attr->type = allocs[i].type;
    attr->device = allocs[i].device;
    attr->devicePointer = (void *)ptr;
    attr->hostPointer = allocs[i].type == cudaMemoryTypeHost ? (void *)ptr : NULL;
  }
  pthread_mutex_unlock(&mem_mu);
  return cudaSuccess;
}

/* ---- copies ------------------------------------------------------------------ */

typedef struct copy_job {
  void *dst;
  const void *src;
  size_t bytes;
  void *snapshot; /* a pageable source, read when the copy was queued */
} copy_job_t;

static cudaError_t run_copy(void *arg) {
  copy_job_t *c = arg;
  const void *src = c->snapshot ? c->snapshot : c->src;
  cudaError_t e =
      emu_check_range(c->dst, c->bytes, 1, !is_tracked(c->dst), EMU_WRITE, "cudaMemcpy dst");
  if (e == cudaSuccess && !c->snapshot)
    e = emu_check_range(src, c->bytes, 1, !is_tracked(src), EMU_READ, "cudaMemcpy src");
  if (e == cudaSuccess) memmove(c->dst, src, c->bytes);
  free(c->snapshot);
  return e;
}

static cudaError_t copy(void *dst, const void *src, size_t n, cudaStream_t stream, int async) {
  if (n == 0) return cudaSuccess;
  copy_job_t job = {dst, src, n, NULL};
  int upload = kind_of(src) != cudaMemoryTypeDevice && kind_of(dst) == cudaMemoryTypeDevice;
  if (upload && n > 0 && __atomic_exchange_n(&hold_uploads, 0, 0)) {
    cudaError_t held = (cudaError_t)gs_emulated_hold((uintptr_t)stream);
    if (held != cudaSuccess) return fail(held);
  }
  if (!is_tracked(src) && is_tracked(dst)) {
    /* the runtime stages a pageable source when the call is made; counted
     * for asynchronous copies, because gradsync must not rely on that */
    if (async) __atomic_add_fetch(&pageable_uploads, 1, 0);
    job.snapshot = malloc(n);
    if (!job.snapshot) return fail(cudaErrorMemoryAllocation);
    memcpy(job.snapshot, src, n);
  }
  cudaError_t e = emu_enqueue(stream, run_copy, &job, sizeof job);
  if (e != cudaSuccess) free(job.snapshot);
  return e == cudaSuccess ? e : fail(e);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  (void)kind;
  return copy(dst, src, n, stream, 1);
}

static int on_device(enum cudaMemoryType t) {
  return t == cudaMemoryTypeDevice || t == cudaMemoryTypeManaged;
}

/* The runtime's documented host synchronization: from pageable memory to
 * the device, the legacy stream is synchronized, the source staged and the
 * DMA may still be queued on return; device to device nothing is waited
 * for; otherwise the copy is done on return. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
  (void)kind;
  enum cudaMemoryType from = kind_of(src), to = kind_of(dst);
  if (!(on_device(from) && on_device(to))) emu_blocking_call("cudaMemcpy");
  if (from == cudaMemoryTypeUnregistered && on_device(to)) {
    cudaError_t e = emu_stream_sync(cudaStreamLegacy);
    return e == cudaSuccess ? copy(dst, src, n, cudaStreamLegacy, 0) : e;
  }
  cudaError_t e = copy(dst, src, n, cudaStreamLegacy, 0);
  if (e == cudaSuccess && !(on_device(from) && on_device(to)))
    e = emu_stream_sync(cudaStreamLegacy);
  return e;
}

/* ---- stream-ordered pools: the default one per device, and created ones ---------- */

/* Attributes set on a device's default pool (gs_emulated_default_pool_changes):
 * its release threshold is shared by every library that allocates from it. */
static long default_pool_changes;
static char created_pools[64];
static int ncreated_pools;

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  *pool = (cudaMemPool_t)&context_tokens[device];
  return cudaSuccess;
}

cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props) {
  if (!pool || !props || props->location.type != cudaMemLocationTypeDevice ||
      props->location.id < 0 || props->location.id >= device_count())
    return fail(cudaErrorInvalidValue);
  int k = __atomic_fetch_add(&ncreated_pools, 1, 0);
  if (k >= (int)sizeof created_pools) return fail(cudaErrorMemoryAllocation);
  *pool = (cudaMemPool_t)&created_pools[k];
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value) {
  (void)attr; (void)value;
  char *p = (char *)pool;
  if (p >= context_tokens && p < context_tokens + MAX_DEVICES)
    __atomic_add_fetch(&default_pool_changes, 1, 0);
  return cudaSuccess;
}

__attribute__((visibility("default"))) long gs_emulated_default_pool_changes(void) {
  return __atomic_load_n(&default_pool_changes, 0);
}

/* Memory from a created pool: as cudaMallocAsync's (one tracked kind). */
cudaError_t cudaMallocFromPoolAsync(void **p, size_t n, cudaMemPool_t pool, cudaStream_t stream) {
  char *k = (char *)pool;
  if (!(k >= created_pools && k < created_pools + sizeof created_pools))
    return fail(cudaErrorInvalidValue);
  return cudaMallocAsync(p, n, stream);
}
