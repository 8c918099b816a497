/* Stream semantics of the device path, against the emulated CUDA runtime
 * (its test hooks slow a stream down and ask whether one is busy; on real
 * hardware, without them, this test skips):
 * - gradsync's communication stream is non-blocking: work queued behind a
 *   collective on it never holds up the legacy default stream;
 * - the gradient kernels run on the caller's work stream and return without
 *   waiting for the communication stream;
 * - an asynchronous collective's request hands its device work to the
 *   caller's stream (gs_request_wait_stream) without blocking the host;
 * - misaligned device tensors and overlapping device allgathers are refused
 *   before anything runs, and the communicator stays usable;
 * - gradsync never hands CUDA a pageable buffer to copy asynchronously.
 * It runs gradsync's NCCL path (the emulated NCCL, one emulated GPU per
 * process), where a collective is device work from start to end. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

static int (*emu_sleep)(uintptr_t stream, double seconds);
static int (*emu_hold)(uintptr_t stream); /* busy until emu_release: no race with a clock */
static void (*emu_release)(void);
static int (*emu_busy)(uintptr_t stream);
static int (*emu_sync)(uintptr_t stream);
static long (*emu_pageable_uploads)(void);

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static gs_device_t DEV = {GS_DEVICE_CUDA, 0};
#define LEGACY ((uintptr_t)1)

static gs_tensor_t device_floats(int64_t n, float value) {
  float *h = malloc((size_t)(n ? n : 1) * sizeof *h);
  for (int64_t i = 0; i < n; i++) h[i] = value;
  void *d = NULL;
  GS_OK(gs_malloc(DEV, (size_t)n * sizeof(float), &d));
  GS_OK(gs_memcpy(d, DEV, h, HOST, (size_t)n * sizeof(float)));
  free(h);
  return (gs_tensor_t){d, n, GS_FLOAT32, DEV};
}

static float first_value(const gs_tensor_t *t) {
  float v = -1;
  GS_OK(gs_memcpy(&v, HOST, t->data, DEV, sizeof v));
  return v;
}

static void comm_stream_never_blocks_legacy(uintptr_t comm_stream) {
  SECTION("the communication stream is non-blocking");
  gs_tensor_t x = device_floats(1000, 2.0f);
  emu_hold(comm_stream);  /* a collective that has not finished */
  GS_OK(gs_zero(&x, 1)); /* the caller's work: legacy default stream */
  CHECK(emu_sync(LEGACY) == 0, "legacy stream sync failed");
  CHECK(emu_busy(comm_stream), "the legacy default stream waited for gradsync's stream");
  emu_release();
  SECTION("the gradient kernels run on the caller's stream without waiting");
  gs_tensor_t y = device_floats(1000, 3.0f);
  emu_hold(comm_stream);
  GS_OK(gs_accumulate(&x, &y, 1, 0));
  GS_OK(gs_scale(&x, 1, 2.0));
  int finite = 0;
  GS_OK(gs_all_finite(&x, 1, &finite));
  CHECK(finite == 1, "all_finite: %d", finite);
  CHECK(emu_busy(comm_stream), "a kernel waited for gradsync's communication stream");
  emu_release();
  CHECK(first_value(&x) == 6.0f, "accumulate then scale: %g", (double)first_value(&x));
  emu_sync(comm_stream);
  gs_free(DEV, x.data);
  gs_free(DEV, y.data);
}

static void request_hands_off_to_stream(gs_comm_t c, uintptr_t comm_stream) {
  SECTION("an asynchronous request hands its device work to the caller's stream");
  int p = gs_test_size();
  gs_tensor_t x = device_floats(5000, 1.0f);
  emu_hold(comm_stream);
  gs_request_t r = NULL;
  GS_OK(gs_allreduce_async(c, &x, 1, GS_OP_SUM, 1.0, 1.0, &r));
  GS_OK(gs_request_wait_stream(r, LEGACY));
  CHECK(emu_busy(comm_stream), "gs_request_wait_stream blocked the host until the end");
  emu_release();
  emu_sync(LEGACY); /* the caller's stream waited for the collective */
  CHECK(!emu_busy(comm_stream), "the caller's stream did not wait for the collective");
  CHECK(first_value(&x) == (float)p, "allreduce result %g, want %d", (double)first_value(&x), p);
  GS_OK(gs_request_free(&r));
  gs_free(DEV, x.data);

  SECTION("a request freed after the hand-off does not block, and completes");
  x = device_floats(100, 2.0f);
  emu_hold(comm_stream);
  GS_OK(gs_allreduce_async(c, &x, 1, GS_OP_SUM, 1.0, 1.0, &r));
  GS_OK(gs_request_wait_stream(r, LEGACY));
  GS_OK(gs_request_free(&r));
  CHECK(emu_busy(comm_stream), "gs_request_free waited on the host after a hand-off");
  emu_release();
  GS_OK(gs_barrier(c)); /* blocking calls order after the queue */
  emu_sync(LEGACY);
  CHECK(first_value(&x) == 2.0f * p, "allreduce result %g", (double)first_value(&x));
  gs_free(DEV, x.data);

  SECTION("gs_request_wait waits for the device work on the host");
  x = device_floats(100, 3.0f);
  emu_sleep(comm_stream, 0.2);
  GS_OK(gs_allreduce_async(c, &x, 1, GS_OP_SUM, 1.0, 1.0, &r));
  GS_OK(gs_request_wait(r));
  CHECK(!emu_busy(comm_stream), "gs_request_wait returned before the device work ended");
  int done = 0;
  GS_OK(gs_request_test(r, &done));
  CHECK(done == 1, "test after wait: %d", done);
  GS_OK(gs_request_free(&r));
  gs_free(DEV, x.data);
}

static void refused_arguments(gs_comm_t c) {
  SECTION("a misaligned device tensor is an argument error");
  gs_tensor_t x = device_floats(64, 1.0f);
  gs_tensor_t off = {(char *)x.data + 2, 16, GS_FLOAT32, DEV};
  GS_EXPECT(gs_allreduce(c, &off, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gs_last_error(), "aligned") != NULL, "message: %s", gs_last_error());
  GS_EXPECT(gs_zero(&off, 1), GS_ERR_INVALID_ARGUMENT);
  GS_OK(gs_allreduce(c, &x, NULL, 1, GS_OP_SUM, 1.0, 1.0)); /* still usable */
  CHECK(first_value(&x) == (float)gs_test_size(), "after the refusal: %g", (double)first_value(&x));

  SECTION("allgatherv into memory overlapping its input is refused on the device");
  int p = gs_test_size();
  gs_tensor_t all = device_floats(4 * p, 0.0f);
  gs_tensor_t mine = {(float *)all.data + 1, 4, GS_FLOAT32, DEV}; /* inside the output */
  int64_t *counts = malloc((size_t)p * sizeof *counts);
  for (int r = 0; r < p; r++) counts[r] = 4;
  GS_EXPECT(gs_allgatherv(c, &mine, &all, 1, counts), GS_ERR_INVALID_ARGUMENT);
  CHECK(strstr(gs_last_error(), "overlap") != NULL, "message: %s", gs_last_error());
  free(counts);
  gs_free(DEV, all.data);
  gs_free(DEV, x.data);
}

int main(int argc, char **argv) {
  Dl_info self;
  if (dladdr((void *)&gs_allreduce, &self) && self.dli_fname) { /* its own emulated NCCL */
    setenv("GS_EMU_DISTINCT_GPUS", "1", 1);
    setenv("GRADSYNC_NCCL_LIBRARY", self.dli_fname, 1);
  }
  int provided = gs_test_init_thread(&argc, &argv, "test_device_streams", MPI_THREAD_SERIALIZED);
  emu_sleep = (int (*)(uintptr_t, double))dlsym(RTLD_DEFAULT, "gs_emulated_sleep");
  emu_hold = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_hold");
  emu_release = (void (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_release");
  emu_busy = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_busy");
  emu_sync = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_sync");
  emu_pageable_uploads = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_pageable_uploads");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && emu_sleep && emu_hold && emu_release && emu_busy && emu_sync &&
           provided >= MPI_THREAD_SERIALIZED;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_device_streams: needs the emulated CUDA runtime, skipped\n");
    return gs_test_finish();
  }
  DEV.id = 0; /* the hooks' legacy stream is device 0's */
  gs_comm_t c = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &c));
  gs_tensor_t warm = device_floats(1, 1.0f); /* chooses the device path */
  GS_OK(gs_allreduce(c, &warm, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  gs_free(DEV, warm.data);
  void *stream = NULL;
  GS_OK(gs_cuda_stream(DEV.id, &stream));
  comm_stream_never_blocks_legacy((uintptr_t)stream);
  request_hands_off_to_stream(c, (uintptr_t)stream);
  refused_arguments(c);
  GS_OK(gs_comm_free(&c));
  SECTION("no asynchronous copy from pageable memory");
  CHECK(emu_pageable_uploads() == 0, "%ld host-to-device copies from pageable memory",
        emu_pageable_uploads());
  return gs_test_finish();
}
