/* gs_memcpy: any memory to any memory. Copies touching a device run on the
 * legacy default stream once it follows the thread's work stream (this
 * call's: the caller set it), which then follows the copy: host memory is
 * consumed or filled before this returns, a device destination may still be
 * written after, in those streams' order.
 *
 * Nothing here waits for the device except through the polled wait
 * (gs_cu_event_wait: GRADSYNC_TIMEOUT_SECONDS, interrupts). A synchronous
 * cudaMemcpy waits without bound, behind whatever the legacy stream
 * follows: with an NCCL kernel there waiting for a peer that waits for this
 * host, forever. Pageable host memory goes through pinned staging buffers
 * (the result buffers, ring.c), in chunks, two at a time: an upload copies
 * into one and queues its DMA, and returns without waiting (a buffer is
 * reused once its DMA has run); a download queues the next chunk's DMA
 * before it waits for, and reads, the current one. Pinned host memory is
 * copied directly and waited for; after a timeout a download may still
 * land in it (docs/RELIABILITY.md). */
#include <string.h>

#include "device/gs_cuda.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>

#define CHUNK ((size_t)8 << 20)
#define LEGACY ((void *)cudaStreamLegacy)

static size_t chunk_at(size_t off, size_t bytes) {
  return bytes - off < CHUNK ? bytes - off : CHUNK;
}

/* Pageable src: each chunk staged, its DMA queued; two buffers in turn. */
static gs_status_t upload(char *dst, const char *src, size_t bytes) {
  gs_cu_result_t *r[2] = {NULL, NULL};
  gs_status_t s = GS_SUCCESS;
  for (size_t off = 0, i = 0; s == GS_SUCCESS && off < bytes; off += CHUNK, i++) {
    size_t n = chunk_at(off, bytes);
    gs_cu_result_t **k = &r[i % 2];
    if (*k) s = gs_cu_result_read(*k, NULL, 0, "gs_memcpy: staging an upload"); /* DMA i-2 */
    *k = NULL;
    if (s == GS_SUCCESS) s = gs_cu_result_get(n, k);
    if (s == GS_SUCCESS) s = gs_cu_result_upload(*k, dst + off, src + off, n, LEGACY);
  }
  gs_cu_result_put(r[0]); /* reused once their DMA has run */
  gs_cu_result_put(r[1]);
  return s;
}

/* Pageable dst: chunk i + 1's DMA queued before chunk i is waited for. */
static gs_status_t download(char *dst, const char *src, size_t bytes) {
  gs_cu_result_t *r[2] = {NULL, NULL};
  gs_status_t s = gs_cu_result_get(chunk_at(0, bytes), &r[0]);
  if (s == GS_SUCCESS) s = gs_cu_result_fetch(r[0], src, chunk_at(0, bytes), LEGACY);
  for (size_t off = 0, i = 0; s == GS_SUCCESS && off < bytes; off += CHUNK, i++) {
    size_t next = off + CHUNK;
    gs_cu_result_t **now = &r[i % 2], **later = &r[(i + 1) % 2];
    if (next < bytes) {
      s = gs_cu_result_get(chunk_at(next, bytes), later);
      if (s == GS_SUCCESS)
        s = gs_cu_result_fetch(*later, src + next, chunk_at(next, bytes), LEGACY);
    }
    if (s == GS_SUCCESS) {
      s = gs_cu_result_read(*now, dst + off, chunk_at(off, bytes), "gs_memcpy");
      *now = NULL; /* read gave it back, done or not */
    }
  }
  gs_cu_result_put(r[0]); /* a copy still pending: reused once it has run */
  gs_cu_result_put(r[1]);
  return s;
}

static gs_status_t copy_on_legacy(void *dst, gs_device_t dd, const void *src, gs_device_t sd,
                                  size_t bytes) {
  int host_src = sd.kind != GS_DEVICE_CUDA, host_dst = dd.kind != GS_DEVICE_CUDA;
  if (host_src && sd.kind != GS_DEVICE_CUDA_HOST) return upload(dst, src, bytes);
  if (host_dst && dd.kind != GS_DEVICE_CUDA_HOST) return download(dst, src, bytes);
  GS_CHECK(gs_cu_copy(dst, src, bytes, LEGACY));
  if (!host_src && !host_dst) return GS_SUCCESS; /* device to device: stream order only */
  return gs_cu_stream_wait(LEGACY, "gs_memcpy"); /* pinned memory read or filled */
}

static gs_status_t device_copy(void *dst, gs_device_t dd, const void *src, gs_device_t sd,
                               size_t bytes) {
  int device = dd.kind == GS_DEVICE_CUDA ? dd.id : sd.id;
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(device, &scope));
  void *work = gs_cu_work_stream();
  gs_status_t s = gs_cu_order(LEGACY, work, "gs_memcpy");
  if (s == GS_SUCCESS) s = copy_on_legacy(dst, dd, src, sd, bytes);
  /* the queued part of a failed copy too: later work follows it */
  gs_status_t after = gs_cu_order(work, LEGACY, "gs_memcpy");
  gs_cu_leave(&scope);
  return s != GS_SUCCESS ? s : after;
}
#endif

gs_status_t gs_memcpy(void *dst, gs_device_t dst_device, const void *src, gs_device_t src_device,
                      size_t bytes) {
  gs_clear_error();
  if (!bytes) return GS_SUCCESS;
  if (!dst || !src)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_memcpy: %s is NULL", dst ? "src" : "dst");
#ifdef GS_HAVE_CUDA
  /* host memory the CUDA runtime does not stage: plain memmove */
  if (dst_device.kind == GS_DEVICE_CUDA || src_device.kind == GS_DEVICE_CUDA)
    return device_copy(dst, dst_device, src, src_device, bytes);
#else
  if (dst_device.kind == GS_DEVICE_CUDA || src_device.kind == GS_DEVICE_CUDA)
    return gs_fail(GS_ERR_UNSUPPORTED, "gs_memcpy: this gradsync was built without CUDA");
#endif
  memmove(dst, src, bytes);
  return GS_SUCCESS;
}
