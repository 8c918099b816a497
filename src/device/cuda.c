/* The device runtime (gs_cuda.h): contexts, streams, events, waits and
 * errors. In a build without CUDA the public entry points say so and the
 * internal ones are never reached (no tensor gets to a device path). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gs_info.h"
#include "device/gs_cuda.h"

#ifndef GS_CUDA_ARCHS
#define GS_CUDA_ARCHS ""
#endif

int gs_cuda_built(void) {
#ifdef GS_HAVE_CUDA
  return 1;
#else
  return 0;
#endif
}

const char *gs_cuda_archs(void) { return GS_CUDA_ARCHS; }

#ifdef GS_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>

#define MAX_DEVICES 64

/* ---- errors ------------------------------------------------------------------ */

/* Errors after which the context is lost and every later call fails. */
static int sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorExternalDevice: return 1;
    default: return 0;
  }
}

gs_status_t gs_cu_fail(int code, const char *what) {
  cudaError_t e = (cudaError_t)code;
  if (!sticky(e)) {
    cudaGetLastError(); /* a non-sticky error: the next call starts clean */
    return gs_fail(GS_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  gs_runtime_mark_broken(GS_ERR_CUDA);
  return gs_fail(GS_ERR_CUDA,
                 "%s: %s (%s). This error is sticky: the process's CUDA context "
                 "is lost and every later CUDA call fails; the communicator is no longer "
                 "usable (restart the process)",
                 what, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CU_CHECK(call, what)                                    \
  do {                                                          \
    cudaError_t cu_e_ = (call);                                 \
    if (cu_e_ != cudaSuccess) return gs_cu_fail(cu_e_, (what)); \
  } while (0)

/* ---- version and devices -------------------------------------------------------- */

int gs_cuda_version(void) {
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : CUDART_VERSION;
}

gs_status_t gs_cuda_device_count(int *count) {
  if (!count) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_device_count: count is NULL");
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e == cudaSuccess) return GS_SUCCESS;
  *count = 0;
  cudaGetLastError();
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) cudaGetLastError();
  /* the runtime says "insufficient driver" also when there is none at all */
  if (e == cudaErrorInsufficientDriver && driver > 0) {
    return gs_fail(GS_ERR_CUDA,
                   "gs_cuda_device_count: the NVIDIA driver supports CUDA %d.%d, "
                   "but this gradsync was built with the CUDA %d.%d runtime, which needs a "
                   "driver for CUDA %d.%d or newer (cudaErrorInsufficientDriver): update the "
                   "driver, or rebuild gradsync with an older CUDA toolkit",
                   driver / 1000, driver % 1000 / 10, CUDART_VERSION / 1000,
                   CUDART_VERSION % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
  }
  /* no driver or no device: none, which is not an error */
  return GS_SUCCESS;
}

gs_status_t gs_cuda_get_device(int *device) {
  if (!device) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_get_device: device is NULL");
  CU_CHECK(cudaGetDevice(device), "gs_cuda_get_device");
  return GS_SUCCESS;
}

/* ---- contexts: pushed and popped, never created for the caller ----------------------- */

typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*push_fn)(CUcontext);
typedef CUresult (*pop_fn)(CUcontext *);
typedef CUresult (*current_fn)(CUcontext *);
typedef CUresult (*state_fn)(CUdevice, unsigned int *, int *);
static struct {
  retain_fn retain;
  push_fn push;
  pop_fn pop;
  current_fn current;
  state_fn state;
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static CUcontext primary[MAX_DEVICES];
static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;

static void *entry(const char *name) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return fn;
}

static void load_driver(void) {
  drv.retain = (retain_fn)entry("cuDevicePrimaryCtxRetain");
  drv.push = (push_fn)entry("cuCtxPushCurrent");
  drv.pop = (pop_fn)entry("cuCtxPopCurrent");
  drv.current = (current_fn)entry("cuCtxGetCurrent");
  drv.state = (state_fn)entry("cuDevicePrimaryCtxGetState");
}

/* gradsync's kernels, loaded into each device's primary context at its
 * first entry (gs_cu_load_kernels says why), before gradsync queues any
 * NCCL work there. A device whose load fails (no kernel image for its
 * architecture) still serves memory and copies; its kernel launches fail
 * with the same error, naming the call. */
static unsigned char kernels_tried[MAX_DEVICES];

static void load_kernels(int device) {
  if (__atomic_load_n(&kernels_tried[device], __ATOMIC_ACQUIRE)) return;
  pthread_mutex_lock(&device_lock);
  if (!kernels_tried[device]) {
    int e = gs_cu_load_kernels();
    if (e) {
      gs_log(GS_LOG_WARNING, "gradsync's CUDA kernels do not load on device %d: %s (built for %s)",
             device, cudaGetErrorString((cudaError_t)e), GS_CUDA_ARCHS);
      cudaGetLastError();
    }
    /* set once loaded: a thread that finds it set launches loaded kernels */
    __atomic_store_n(&kernels_tried[device], 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&device_lock);
}

gs_status_t gs_cu_enter(int device, gs_cu_scope_t *scope) {
  scope->device = device;
  scope->pushed = 0;
  if (device < 0 || device >= MAX_DEVICES)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "CUDA device %d is out of range", device);
  pthread_once(&drv_once, load_driver);
  if (!drv.retain || !drv.push || !drv.pop || !drv.current)
    return gs_fail(GS_ERR_CUDA,
                   "gradsync: the CUDA driver does not provide the context entry "
                   "points (cuCtxPushCurrent, ...) gradsync uses; update the driver");
  pthread_mutex_lock(&device_lock);
  CUresult r = primary[device] ? CUDA_SUCCESS : drv.retain(&primary[device], device);
  CUcontext ctx = primary[device];
  pthread_mutex_unlock(&device_lock);
  if (r != CUDA_SUCCESS)
    return gs_fail(GS_ERR_CUDA,
                   "gradsync: cannot use CUDA device %d (its primary context: "
                   "driver error %d)",
                   device, (int)r);
  CUcontext now = NULL;
  if (drv.current(&now) != CUDA_SUCCESS || now != ctx) {
    if (drv.push(ctx) != CUDA_SUCCESS)
      return gs_fail(GS_ERR_CUDA, "gradsync: cannot make CUDA device %d current", device);
    scope->pushed = 1;
  }
  load_kernels(device);
  return GS_SUCCESS;
}

void gs_cu_leave(gs_cu_scope_t *scope) {
  if (scope->pushed) drv.pop(NULL);
  scope->pushed = 0;
}

gs_status_t gs_cu_enter_existing(gs_cu_scope_t *scope, int *none) {
  scope->device = -1;
  scope->pushed = 0;
  *none = 0;
  pthread_once(&drv_once, load_driver);
  if (!drv.current || !drv.state)
    return gs_fail(GS_ERR_CUDA,
                   "gradsync: the CUDA driver does not provide the context entry "
                   "points (cuCtxGetCurrent, ...) gradsync uses; update the driver");
  CUcontext now = NULL;
  if (drv.current(&now) == CUDA_SUCCESS && now) return GS_SUCCESS; /* the thread's own */
  int count = 0, first = 0; /* neither call creates a context */
  if (cudaGetDeviceCount(&count) != cudaSuccess || cudaGetDevice(&first) != cudaSuccess)
    cudaGetLastError();
  for (int k = 0; k < count && k < MAX_DEVICES; k++) {
    int d = k == 0 ? first : k - 1 < first ? k - 1 : k; /* the current device first */
    unsigned int flags = 0;
    int active = 0;
    if (drv.state(d, &flags, &active) == CUDA_SUCCESS && active) return gs_cu_enter(d, scope);
  }
  *none = 1;
  return GS_SUCCESS;
}

/* ---- streams ------------------------------------------------------------------------- */

/* Each communicator has a stream of its own (gs_cu_stream_create): NCCL
 * kernels block until every rank has joined, so two communicators sharing
 * one stream deadlock when their calls are queued in different orders on
 * different ranks (two threads, one per communicator). The device's entry
 * stream (gs_cuda_stream) carries no work of gradsync's: what the caller
 * queues there, or orders there with gs_cuda_order_after, every later
 * collective on the device follows. */
static cudaStream_t entry_streams[MAX_DEVICES];
static cudaStream_t memory_streams[MAX_DEVICES];
static _Thread_local uintptr_t work_stream; /* 0: legacy default */

gs_status_t gs_cu_stream_create(void **stream, const char *what) {
  cudaStream_t s = NULL;
  CU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what);
  *stream = s;
  return GS_SUCCESS;
}

void gs_cu_stream_destroy(void *stream) {
  /* CUDA releases it once the work queued on it has finished */
  if (stream && cudaStreamDestroy((cudaStream_t)stream) != cudaSuccess) cudaGetLastError();
}

static gs_status_t entry_stream(int device, cudaStream_t *stream) {
  pthread_mutex_lock(&device_lock);
  cudaError_t e = cudaSuccess;
  if (!entry_streams[device])
    e = cudaStreamCreateWithFlags(&entry_streams[device], cudaStreamNonBlocking);
  *stream = entry_streams[device];
  pthread_mutex_unlock(&device_lock);
  if (e != cudaSuccess) return gs_cu_fail(e, "gradsync: creating the device's entry stream");
  return GS_SUCCESS;
}

static cudaStream_t alloc_streams[MAX_DEVICES];

gs_status_t gs_cu_alloc_stream(int device, void **stream) {
  pthread_mutex_lock(&device_lock);
  cudaError_t e = cudaSuccess;
  if (!alloc_streams[device])
    e = cudaStreamCreateWithFlags(&alloc_streams[device], cudaStreamNonBlocking);
  *stream = alloc_streams[device];
  pthread_mutex_unlock(&device_lock);
  if (e != cudaSuccess) return gs_cu_fail(e, "gradsync: creating its CUDA stream for allocations");
  return GS_SUCCESS;
}

gs_status_t gs_cu_follow_entry(int device, void *stream) {
  pthread_mutex_lock(&device_lock);
  cudaStream_t entry = entry_streams[device];
  pthread_mutex_unlock(&device_lock);
  if (!entry) return GS_SUCCESS; /* nobody asked for it: nothing to follow */
  return gs_cu_order(stream, entry, "gradsync: ordering after the device's entry stream");
}

gs_status_t gs_cu_memory_stream(int device, void **stream) {
  pthread_mutex_lock(&device_lock);
  cudaError_t e = cudaSuccess;
  if (!memory_streams[device])
    e = cudaStreamCreateWithFlags(&memory_streams[device], cudaStreamNonBlocking);
  *stream = memory_streams[device];
  pthread_mutex_unlock(&device_lock);
  if (e != cudaSuccess) return gs_cu_fail(e, "gradsync: creating its memory stream");
  return GS_SUCCESS;
}

gs_status_t gs_cu_stream_key(void *stream, unsigned long long *key) {
  int device = 0;
  if (stream == (void *)cudaStreamLegacy && cudaGetDevice(&device) == cudaSuccess) {
    *key = ~0ull - (unsigned long long)device; /* one legacy stream per device */
    return GS_SUCCESS;
  }
  CU_CHECK(cudaStreamGetId((cudaStream_t)stream, key), "gradsync: naming a CUDA stream");
  return GS_SUCCESS;
}

static cudaStream_t as_stream(uintptr_t s) {
  return s == 0 || s == 1 ? cudaStreamLegacy : s == 2 ? cudaStreamPerThread : (cudaStream_t)s;
}

void *gs_cu_work_stream(void) { return as_stream(work_stream); }
void *gs_cu_as_stream(uintptr_t stream) { return as_stream(stream); }

gs_status_t gs_cuda_set_stream(uintptr_t stream) {
  work_stream = stream;
  return GS_SUCCESS;
}

uintptr_t gs_cuda_get_stream(void) { return work_stream ? work_stream : 1; }

/* ---- events ---------------------------------------------------------------------------- */

typedef struct pooled {
  cudaEvent_t ev;
  int device;
  struct pooled *next;
} pooled_t;
static pooled_t *free_events[MAX_DEVICES];

gs_status_t gs_cu_record(void *stream, void **event, const char *what) {
  int device = 0;
  CU_CHECK(cudaGetDevice(&device), what);
  pthread_mutex_lock(&device_lock);
  pooled_t *p = device < MAX_DEVICES ? free_events[device] : NULL;
  if (p) free_events[device] = p->next;
  pthread_mutex_unlock(&device_lock);
  if (!p) {
    p = calloc(1, sizeof *p);
    if (!p) return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", what);
    cudaError_t e = cudaEventCreateWithFlags(&p->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      free(p);
      return gs_cu_fail(e, what);
    }
    p->device = device;
  }
  cudaError_t e = cudaEventRecord(p->ev, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    gs_cu_event_free(p);
    return gs_cu_fail(e, what);
  }
  *event = p;
  return GS_SUCCESS;
}

void gs_cu_event_free(void *event) {
  pooled_t *p = event;
  if (!p) return;
  pthread_mutex_lock(&device_lock);
  p->next = free_events[p->device];
  free_events[p->device] = p;
  pthread_mutex_unlock(&device_lock);
}

int gs_cu_event_poll(void *event, const char *what) {
  cudaError_t e = cudaEventQuery(((pooled_t *)event)->ev);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  gs_cu_fail(e, what);
  return -1;
}

gs_status_t gs_cu_stream_wait_event(void *stream, void *event, const char *what) {
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, ((pooled_t *)event)->ev, 0);
  return e == cudaSuccess ? GS_SUCCESS : gs_cu_fail(e, what);
}

gs_status_t gs_cu_order(void *waiter, void *producer, const char *what) {
  if (waiter == producer) return GS_SUCCESS;
  void *ev = NULL;
  GS_CHECK(gs_cu_record(producer, &ev, what));
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)waiter, ((pooled_t *)ev)->ev, 0);
  gs_cu_event_free(ev); /* the wait took the event's state when it was queued */
  if (e != cudaSuccess) return gs_cu_fail(e, what);
  return GS_SUCCESS;
}

typedef struct event_wait {
  void *event;
  const char *what;
} event_wait_t;

static int event_poll(void *ctx, gs_status_t *err) {
  event_wait_t *w = ctx;
  int r = gs_cu_event_poll(w->event, w->what);
  if (r < 0) *err = GS_ERR_CUDA;
  return r;
}

gs_status_t gs_cu_event_wait(void *event, const char *what) {
  event_wait_t ctx = {event, what};
  gs_wait_t w = {event_poll, NULL, NULL, NULL, &ctx, what};
  return gs_progress_wait(&w);
}

gs_status_t gs_cu_stream_wait(void *stream, const char *what) {
  void *ev = NULL;
  GS_CHECK(gs_cu_record(stream, &ev, what));
  gs_status_t s = gs_cu_event_wait(ev, what);
  gs_cu_event_free(ev);
  return s;
}

/* ---- the public stream API --------------------------------------------------------------- */

gs_status_t gs_cuda_stream(int device, void **stream) {
  gs_clear_error();
  if (!stream) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_stream: stream is NULL");
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  cudaStream_t s = NULL;
  gs_status_t st = entry_stream(device, &s);
  *stream = s;
  gs_cu_leave(&scope);
  return st;
}

gs_status_t gs_cuda_order_after(int device, uintptr_t stream) {
  gs_clear_error();
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  cudaStream_t entry = NULL;
  gs_status_t s = entry_stream(device, &entry);
  if (s == GS_SUCCESS) s = gs_cu_order(entry, as_stream(stream), "gs_cuda_order_after");
  gs_cu_leave(&scope);
  return s;
}

gs_status_t gs_cuda_stream_order(int device, uintptr_t waiter, uintptr_t producer) {
  gs_clear_error();
  if (as_stream(waiter) == as_stream(producer)) return GS_SUCCESS;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  gs_status_t s = gs_cu_order(as_stream(waiter), as_stream(producer), "gs_cuda_stream_order");
  gs_cu_leave(&scope);
  return s;
}

#else /* no CUDA */

static gs_status_t no_cuda(const char *what) {
  return gs_fail(GS_ERR_UNSUPPORTED,
                 "%s: this gradsync was built without CUDA (rebuild with "
                 "nvcc on PATH and GRADSYNC_CUDA unset)",
                 what);
}
int gs_cuda_version(void) { return 0; }
gs_status_t gs_cuda_device_count(int *count) {
  if (!count) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_cuda_device_count: count is NULL");
  *count = 0;
  return GS_SUCCESS;
}
gs_status_t gs_cuda_get_device(int *device) {
  (void)device;
  return no_cuda("gs_cuda_get_device");
}
gs_status_t gs_cuda_stream(int device, void **stream) {
  (void)device;
  (void)stream;
  return no_cuda("gs_cuda_stream");
}
gs_status_t gs_cuda_order_after(int device, uintptr_t stream) {
  (void)device;
  (void)stream;
  return no_cuda("gs_cuda_order_after");
}
gs_status_t gs_cuda_stream_order(int device, uintptr_t waiter, uintptr_t producer) {
  (void)device;
  (void)waiter;
  (void)producer;
  return no_cuda("gs_cuda_stream_order");
}
gs_status_t gs_cuda_set_stream(uintptr_t stream) {
  (void)stream;
  return GS_SUCCESS; /* nothing runs on a device: there is no stream to use */
}
uintptr_t gs_cuda_get_stream(void) { return 1; }
#endif
