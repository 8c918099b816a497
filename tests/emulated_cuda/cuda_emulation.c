/* A host stand-in for the CUDA runtime and gradsync's CUDA kernels, so the
 * device paths of the C runtime (engines, staged MPI, batched packing,
 * Adasum's device branch, the kernels API) and the Python layer's device
 * arrays run and are tested on a machine without a GPU.
 *
 * "Device memory" is host memory; one emulated device; streams are ordered
 * trivially because every "asynchronous" operation completes at once. The
 * kernels call gradsync's host kernels, so what this checks is the plumbing
 * (which pointers, counts, offsets and scales reach the kernels, and when),
 * not the CUDA arithmetic: that is checked on a GPU by tests/gpu. Linked
 * instead of cudart and cuda_kernels.cu into build/emulated/libgradsync.so
 * (make test-emulated). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gs_cuda.h"
#include "gs_internal.h"

/* ---- the runtime subset gradsync uses ------------------------------------ */

static int current_device = 0;
static int stream_tokens[4];

cudaError_t cudaGetDeviceCount(int *count) { *count = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *device) { *device = current_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }

cudaError_t cudaMalloc(void **p, size_t n) {
  return posix_memalign(p, 256, n ? n : 256) == 0 ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
  (void)k;
  memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t st) {
  (void)st;
  return cudaMemcpy(d, s, n, k);
}
cudaError_t cudaStreamCreate(cudaStream_t *s) {
  *s = (cudaStream_t)&stream_tokens[current_device];
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  (void)flags;
  *e = (cudaEvent_t)&stream_tokens[3];
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)e; (void)s; return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f) {
  (void)s; (void)e; (void)f;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  memset(prop, 0, sizeof *prop);
  strcpy(prop->name, "gradsync emulated device");
  prop->uuid.bytes[0] = (char)(device + 1); /* every rank: the same device */
  return cudaSuccess;
}

/* Emulated device memory is host memory: every pointer is on device 0. */
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr) {
  memset(attr, 0, sizeof *attr);
  attr->type = ptr ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  attr->device = 0;
  return cudaSuccess;
}

/* ---- the kernels, on the host ------------------------------------------------ */

static gs_tensor_t host(void *p, int64_t n, int32_t dtype) {
  return (gs_tensor_t){p, n, (gs_dtype_t)dtype, {GS_DEVICE_CPU, 0}};
}

gs_status_t gs_cu_elementwise(gs_cu_mode_t mode, const gs_cu_run_t *runs, int64_t n,
                              double scale, void *stream) {
  (void)stream;
  for (int64_t k = 0; k < n; k++) {
    const gs_cu_run_t *r = &runs[k];
    gs_tensor_t a = host(r->a, r->count, r->adtype), b = host((void *)r->b, r->count, r->bdtype);
    switch (mode) {
      case GS_CU_ZERO: GS_CHECK(gs_zero(&a, 1)); break;
      case GS_CU_COPY_SCALE: gs_cpu_scale_copy(a.dtype, r->b, r->a, r->count, scale); break;
      case GS_CU_ACCUMULATE: GS_CHECK(gs_accumulate(&a, &b, 1, 0)); break;
      case GS_CU_OVERWRITE: GS_CHECK(gs_accumulate(&a, &b, 1, 1)); break;
    }
  }
  return GS_SUCCESS;
}

gs_status_t gs_cu_nonfinite(const gs_tensor_t *t, int64_t n, int *bad, void *stream) {
  (void)stream;
  *bad = 0;
  for (int64_t i = 0; i < n && !*bad; i++) {
    gs_tensor_t h = host(t[i].data, t[i].count, t[i].dtype);
    int finite = 1;
    GS_CHECK(gs_all_finite(&h, 1, &finite));
    *bad = !finite;
  }
  return GS_SUCCESS;
}

gs_status_t gs_cu_adasum_dots(gs_dtype_t dtype, const void *a, const void *b,
                              const int64_t *start, const int64_t *count, int64_t n, double *d,
                              void *stream) {
  (void)stream;
  size_t es = gs_dtype_size(dtype);
  for (int64_t j = 0; j < n; j++) {
    d[3 * j] = d[3 * j + 1] = d[3 * j + 2] = 0.0;
    gs_cpu_adasum_dots(dtype, (const char *)a + (size_t)start[j] * es,
                       (const char *)b + (size_t)start[j] * es, count[j], &d[3 * j]);
  }
  return GS_SUCCESS;
}

gs_status_t gs_cu_adasum_combine(gs_dtype_t dtype, const void *a, const void *b, void *out,
                                 const int64_t *start, const int64_t *count, const double *coef,
                                 int64_t n, void *stream) {
  (void)stream;
  size_t es = gs_dtype_size(dtype);
  for (int64_t j = 0; j < n; j++) {
    size_t o = (size_t)start[j] * es;
    gs_cpu_adasum_combine(dtype, coef[2 * j], (const char *)a + o, coef[2 * j + 1],
                          (const char *)b + o, (char *)out + o, count[j]);
  }
  return GS_SUCCESS;
}
