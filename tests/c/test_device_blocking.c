/* No host call of gradsync's waits for the device without bound while
 * device work may be in flight (issue 30): cudaFreeHost, cudaFree, a
 * synchronous cudaMemcpy or a stream or device synchronize waits for the
 * device, and behind an NCCL kernel waiting for a peer that waits for this
 * host, forever, past GRADSYNC_TIMEOUT_SECONDS. Against the emulated CUDA
 * runtime, which counts such calls made while any stream of the device has
 * work queued (gs_emulated_blocking_calls); a gate holds a stream of the
 * test's own busy, as a spinning NCCL kernel would:
 * - busy: the kernel-table ring growing and retiring arenas, a result read
 *   back, staged allreduces growing their pinned staging, gs_memcpy both
 *   ways with pageable and pinned host memory, a communicator freed: none
 *   of them makes such a call (cudaFreeHost, cudaMemcpy did; the caller's
 *   own free of pinned memory is the caller's, made after the gate);
 * - timeout: gs_memcpy to the host from a device whose work stream is held
 *   ends in GS_ERR_TIMEOUT while the gate is still closed (a synchronous
 *   cudaMemcpy waited until the gate opened).
 * Skips where the hooks are absent (real CUDA). */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

static int (*emu_hold)(uintptr_t stream);
static void (*emu_release)(void);
static int (*emu_sync)(uintptr_t stream);
static uintptr_t (*emu_stream)(int nonblocking);
static long (*emu_gates_passed)(void);
static long (*emu_blocking)(void);

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static const gs_device_t PINNED = {GS_DEVICE_CUDA_HOST, 0};
static const gs_device_t DEV = {GS_DEVICE_CUDA, 0};

static float *floats(int64_t n, float value) {
  float *h = malloc((size_t)n * sizeof *h);
  for (int64_t i = 0; i < n; i++) h[i] = value + (float)(i % 7);
  return h;
}

static int64_t differ(const float *a, const float *b, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad += a[i] != b[i];
  return bad;
}

/* acc[i] += grad[i] over n one-element tensors: a table of n runs, which
 * past 18,000 or so outgrows the ring's first arena. */
static void accumulate_views(float *acc, const float *grad, int64_t n) {
  gs_tensor_t *a = malloc((size_t)n * sizeof *a), *g = malloc((size_t)n * sizeof *g);
  for (int64_t i = 0; i < n; i++) {
    a[i] = (gs_tensor_t){acc + i, 1, GS_FLOAT32, DEV};
    g[i] = (gs_tensor_t){(void *)(grad + i), 1, GS_FLOAT32, DEV};
  }
  GS_OK(gs_accumulate(a, g, n, 0));
  free(a);
  free(g);
}

static void ring_and_results(void) {
  const int64_t n = 40000;
  float *h = floats(n, 1.0f), *want = floats(n, 1.0f), *got = floats(n, 0.0f);
  for (int64_t i = 0; i < n; i++) want[i] = 3 * h[i];
  void *acc = NULL, *grad = NULL;
  GS_OK(gs_malloc(DEV, (size_t)n * sizeof(float), &acc));
  GS_OK(gs_malloc(DEV, (size_t)n * sizeof(float), &grad));
  GS_OK(gs_memcpy(acc, DEV, h, HOST, (size_t)n * sizeof(float)));
  GS_OK(gs_memcpy(grad, DEV, h, HOST, (size_t)n * sizeof(float)));
  accumulate_views(acc, grad, n / 2);     /* the ring's second arena */
  accumulate_views(acc, grad, n);         /* its third: the others retire */
  accumulate_views((float *)acc + n / 2, (float *)grad + n / 2, n / 2);
  CHECK(emu_sync(1) == 0, "the launches failed");
  gs_tensor_t all = {acc, n, GS_FLOAT32, DEV};
  int finite = 0;
  GS_OK(gs_all_finite(&all, 1, &finite)); /* a result read back; old arenas reclaimed */
  CHECK(finite, "gs_all_finite says the values are not finite");
  GS_OK(gs_memcpy(got, HOST, acc, DEV, (size_t)n * sizeof(float)));
  CHECK(differ(got, want, n) == 0, "accumulated values are wrong");
  GS_OK(gs_free(DEV, acc));
  GS_OK(gs_free(DEV, grad));
  free(h);
  free(want);
  free(got);
}

/* Both ways, pageable and pinned host memory (`pin`, n floats: the
 * caller's own pinned memory, whose allocation and free are the caller's
 * calls, made outside the held region), and device to device. */
#define COPY_N ((int64_t)3 << 20) /* 12 MiB: two staging chunks */
static void copies(float *pin) {
  const int64_t n = COPY_N;
  size_t bytes = (size_t)n * sizeof(float);
  float *h = floats(n, 5.0f), *back = floats(n, 0.0f);
  void *d = NULL, *d2 = NULL;
  GS_OK(gs_malloc(DEV, bytes, &d));
  GS_OK(gs_malloc(DEV, bytes, &d2));
  GS_OK(gs_memcpy(d, DEV, h, HOST, bytes));
  GS_OK(gs_memcpy(d2, DEV, d, DEV, bytes));
  GS_OK(gs_memcpy(pin, PINNED, d2, DEV, bytes));
  CHECK(differ(pin, h, n) == 0, "device to pinned memory: wrong values");
  for (int64_t i = 0; i < n; i++) pin[i] += 1.0f;
  GS_OK(gs_memcpy(d, DEV, pin, PINNED, bytes));
  GS_OK(gs_memcpy(back, HOST, d, DEV, bytes));
  for (int64_t i = 0; i < n; i++) h[i] += 1.0f;
  CHECK(differ(back, h, n) == 0, "pinned memory to device to pageable memory: wrong values");
  GS_OK(gs_free(DEV, d));
  GS_OK(gs_free(DEV, d2));
  free(h);
  free(back);
}

static void staged_allreduces(gs_comm_t c) {
  const int64_t sizes[2] = {64, 1 << 16};
  for (int k = 0; k < 2; k++) {
    int64_t n = sizes[k];
    size_t bytes = (size_t)n * sizeof(float);
    float *h = floats(n, 2.0f), *got = floats(n, 0.0f), *want = floats(n, 2.0f);
    for (int64_t i = 0; i < n; i++) want[i] = h[i] * (float)gs_test_size();
    void *d = NULL;
    GS_OK(gs_malloc(DEV, bytes, &d));
    GS_OK(gs_memcpy(d, DEV, h, HOST, bytes));
    gs_tensor_t t = {d, n, GS_FLOAT32, DEV};
    GS_OK(gs_allreduce(c, &t, &t, 1, GS_OP_SUM, 1.0, 1.0));
    GS_OK(gs_memcpy(got, HOST, d, DEV, bytes));
    CHECK(differ(got, want, n) == 0, "staged allreduce of %lld floats: wrong values", (long long)n);
    GS_OK(gs_free(DEV, d));
    free(h);
    free(got);
    free(want);
  }
}

static void busy(void) {
  SECTION("busy: nothing waits for the whole device while a stream is held");
  uintptr_t held = emu_stream(1);
  setenv("GRADSYNC_NCCL", "0", 1);
  setenv("GRADSYNC_STAGE_CHUNK_BYTES", "1048576", 1);
  gs_comm_t c = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &c));
  float *pin = NULL;
  GS_OK(gs_malloc(PINNED, (size_t)COPY_N * sizeof(float), (void **)&pin));
  long before = emu_blocking();
  emu_hold(held);
  ring_and_results();
  copies(pin);
  staged_allreduces(c);
  GS_OK(gs_comm_free(&c));
  long made = emu_blocking() - before;
  emu_release();
  CHECK(emu_sync(held) == 0, "the held stream failed");
  GS_OK(gs_free(PINNED, pin));
  CHECK(made == 0, "%ld host calls waited for the device without bound (stderr names them)", made);
  unsetenv("GRADSYNC_NCCL");
  unsetenv("GRADSYNC_STAGE_CHUNK_BYTES");
}

static void timeout(void) {
  SECTION("timeout: gs_memcpy from a held device ends in a timeout");
  const int64_t n = 1000;
  size_t bytes = (size_t)n * sizeof(float);
  float *h = floats(n, 7.0f), *got = floats(n, 0.0f);
  void *d = NULL;
  GS_OK(gs_malloc(DEV, bytes, &d));
  GS_OK(gs_memcpy(d, DEV, h, HOST, bytes));
  uintptr_t s = emu_stream(1);
  gs_set_timeout_seconds(2.0);
  long passed = emu_gates_passed();
  emu_hold(s);
  GS_OK(gs_cuda_set_stream(s));
  gs_status_t st = gs_memcpy(got, HOST, d, DEV, bytes);
  long after = emu_gates_passed();
  GS_OK(gs_cuda_set_stream(1));
  emu_release();
  gs_set_timeout_seconds(0);
  CHECK(st == GS_ERR_TIMEOUT, "gs_memcpy behind held device work returned %d (%s), not a timeout",
        (int)st, gs_last_error());
  CHECK(after == passed, "gs_memcpy returned only once the held device work had run");
  CHECK(emu_sync(s) == 0 && emu_sync(1) == 0, "the held work failed");
  GS_OK(gs_memcpy(got, HOST, d, DEV, bytes));
  CHECK(differ(got, h, n) == 0, "the values after the timeout are wrong");
  GS_OK(gs_free(DEV, d));
  free(h);
  free(got);
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_device_blocking");
  emu_hold = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_hold");
  emu_release = (void (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_release");
  emu_sync = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_sync");
  emu_stream = (uintptr_t (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_stream");
  emu_gates_passed = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_gates_passed");
  emu_blocking = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_blocking_calls");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && emu_hold && emu_release && emu_sync && emu_stream && emu_gates_passed &&
           emu_blocking;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_device_blocking: needs the emulated CUDA runtime, skipped\n");
    return gs_test_finish();
  }
  busy();
  timeout();
  return gs_test_finish();
}
