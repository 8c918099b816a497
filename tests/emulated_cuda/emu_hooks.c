/* Emulated CUDA: the test hooks (see emu.h). Exported: tests find them
 * with dlsym (ctypes) and skip where they are absent, on hardware. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "emu.h"


#define HOOK __attribute__((visibility("default")))

static cudaStream_t as_handle(uintptr_t s) {
  return s == 0 || s == 1 ? cudaStreamLegacy : s == 2 ? cudaStreamPerThread : (cudaStream_t)s;
}

static cudaError_t sleep_op(void *arg) {
  double seconds = *(double *)arg;
  struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&t, NULL);
  return cudaSuccess;
}

static cudaError_t fault_op(void *arg) { return *(cudaError_t *)arg; }

/* Queues `seconds` of device work on `stream` (of the current device). */
HOOK int gs_emulated_sleep(uintptr_t stream, double seconds) {
  return emu_enqueue(as_handle(stream), sleep_op, &seconds, sizeof seconds);
}

/* A gate: device work that lasts until gs_emulated_release (or 30 s, so a
 * test whose host waits behind a gate fails its check instead of hanging).
 * Tests that ask "is the stream still busy?" hold it with a gate rather than
 * a sleep, which a loaded machine could outlast. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_opened = PTHREAD_COND_INITIALIZER;
static unsigned long gate_generation; /* bumped by each release */
static unsigned long gates_passed;    /* gates whose stream went on past them */

static cudaError_t gate_op(void *arg) {
  unsigned long closed_in = *(unsigned long *)arg;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 30;
  pthread_mutex_lock(&gate_mu);
  int r = 0;
  while (gate_generation == closed_in && r == 0)
    r = pthread_cond_timedwait(&gate_opened, &gate_mu, &until);
  gates_passed++;
  pthread_mutex_unlock(&gate_mu);
  return cudaSuccess;
}

/* Gates passed so far (opened, or past their 30 s): a test that finds the
 * count unchanged knows the work behind its gate has not run yet, however
 * much else it queued behind it. */
HOOK long gs_emulated_gates_passed(void) {
  pthread_mutex_lock(&gate_mu);
  long n = (long)gates_passed;
  pthread_mutex_unlock(&gate_mu);
  return n;
}

/* Queues a closed gate on `stream`: it stays busy until the next release. */
HOOK int gs_emulated_hold(uintptr_t stream) {
  pthread_mutex_lock(&gate_mu);
  unsigned long generation = gate_generation;
  pthread_mutex_unlock(&gate_mu);
  return emu_enqueue(as_handle(stream), gate_op, &generation, sizeof generation);
}

/* Opens every gate queued so far. */
HOOK void gs_emulated_release(void) {
  pthread_mutex_lock(&gate_mu);
  gate_generation++;
  pthread_cond_broadcast(&gate_opened);
  pthread_mutex_unlock(&gate_mu);
}

/* Queues work that fails with `error` (a sticky one loses the context). */
HOOK int gs_emulated_fault(uintptr_t stream, int error) {
  cudaError_t e = (cudaError_t)error;
  return emu_enqueue(as_handle(stream), fault_op, &e, sizeof e);
}

/* 1 while `stream` has work queued or running. */
HOOK int gs_emulated_busy(uintptr_t stream) {
  return cudaStreamQuery(as_handle(stream)) == cudaErrorNotReady;
}

/* A stream of the test's own on the current device (non-blocking: the
 * legacy default stream does not wait for it), as a caller's CAI stream. */
HOOK uintptr_t gs_emulated_stream(int nonblocking) {
  cudaStream_t s = NULL;
  if (cudaStreamCreateWithFlags(&s, nonblocking ? cudaStreamNonBlocking : 0) != cudaSuccess)
    return 0;
  return (uintptr_t)s;
}

/* Waits on the host for `stream`. */
HOOK int gs_emulated_sync(uintptr_t stream) { return emu_stream_sync(as_handle(stream)); }

/* Host calls that waited for the device without bound while it had work
 * queued (emu_blocking_call). */
HOOK long gs_emulated_blocking_calls(void) { return emu_blocking_calls(); }

/* Destroys a stream the test made (as torch or CuPy may destroy a side stream). */
HOOK int gs_emulated_stream_destroy(uintptr_t stream) {
  return cudaStreamDestroy(as_handle(stream));
}

/* Uses of a destroyed stream's handle seen so far. */
HOOK long gs_emulated_destroyed_stream_uses(void) { return emu_destroyed_uses(); }

/* A consumer's read of device memory on `stream`: `bytes` at `src` copied
 * into host memory at `dst` when the stream gets there. */
HOOK int gs_emulated_read(uintptr_t stream, void *dst, const void *src, size_t bytes) {
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_handle(stream));
}
