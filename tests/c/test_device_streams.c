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
 * - gradsync never hands CUDA a pageable buffer to copy asynchronously;
 * - every communicator has a stream of its own: two threads driving two
 *   communicators whose collectives are issued in opposite orders on
 *   different ranks both complete (on one shared stream, NCCL kernels that
 *   block until every rank joins deadlock until the timeout);
 * - gs_cuda_order_after orders every communicator's later collectives on
 *   the device after the caller's stream, gs_comm_cuda_order_after one's.
 * It runs gradsync's NCCL path (the emulated NCCL, one emulated GPU per
 * process), where a collective is device work from start to end. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include "gs_test.h"

static int (*emu_sleep)(uintptr_t stream, double seconds);
static int (*emu_hold)(uintptr_t stream); /* busy until emu_release: no race with a clock */
static void (*emu_release)(void);
static int (*emu_busy)(uintptr_t stream);
static int (*emu_sync)(uintptr_t stream);
static long (*emu_pageable_uploads)(void);
static long (*emu_nccl_launches)(void);
static uintptr_t (*emu_new_stream)(int nonblocking);

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static gs_device_t DEV = {GS_DEVICE_CUDA, 0};
#define LEGACY ((uintptr_t)1)

static gs_tensor_t device_floats(int64_t n, float value) {
  float *h = malloc((size_t)(n ? n : 1) * sizeof *h);
  for (int64_t i = 0; i < n; i++) h[i] = value;
  void *d = NULL;
  GS_OK(gs_malloc(DEV, (size_t)n * sizeof(float), &d));
  GS_OK(gs_memcpy(d, DEV, h, HOST, (size_t)n * sizeof(float)));
  /* an upload from pageable memory returns with its DMA still queued on
   * the legacy stream, which the sections' own streams do not follow */
  CHECK(emu_sync(LEGACY) == 0, "the upload failed");
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

/* One thread's collective: an allreduce of `x` on `comm`, issued only once
 * the emulated NCCL has launched `after` operations in this process (the
 * other thread's collective is queued on its device: an ordering handshake,
 * not a sleep). */
typedef struct issuer {
  gs_comm_t comm;
  gs_tensor_t x;
  long after; /* 0: at once */
  int handshake_ok;
  gs_status_t status;
  char error[512];
} issuer_t;

static void *issue(void *arg) {
  issuer_t *t = arg;
  for (int k = 0; t->after && emu_nccl_launches() < t->after && k < 30000; k++) usleep(1000);
  t->handshake_ok = !t->after || emu_nccl_launches() >= t->after;
  t->status = gs_allreduce(t->comm, &t->x, NULL, 1, GS_OP_SUM, 1.0, 1.0);
  snprintf(t->error, sizeof t->error, "%s", gs_last_error());
  return NULL;
}

static void opposite_issue_orders(void) {
  SECTION("two threads, two communicators, opposite issue orders on different ranks");
  int p = gs_test_size(), me = gs_test_rank();
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.check = 0; /* validation would meet over MPI first, in each rank's own order */
  gs_comm_t a = NULL, b = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &a));
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &b));
  issuer_t ta = {a, device_floats(4096, 1.0f + (float)me), 0, 0, GS_SUCCESS, ""};
  issuer_t tb = {b, device_floats(4096, 10.0f * (float)(me + 1)), 0, 0, GS_SUCCESS, ""};
  /* the device paths are chosen (collectively), in the same order everywhere */
  GS_OK(gs_allreduce(a, &ta.x, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  GS_OK(gs_allreduce(b, &tb.x, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  void *sa = NULL, *sb = NULL;
  GS_OK(gs_comm_cuda_stream(a, &sa));
  GS_OK(gs_comm_cuda_stream(b, &sb));
  CHECK(sa && sb && sa != sb, "the communicators' streams: %p and %p", sa, sb);
  gs_set_timeout_seconds(5.0); /* a deadlock ends in GS_ERR_TIMEOUT */
  /* rank 0 issues on a, then b; every other rank on b, then a */
  issuer_t *first = me == 0 ? &ta : &tb, *second = me == 0 ? &tb : &ta;
  second->after = emu_nccl_launches() + 1;
  pthread_t th[2];
  pthread_create(&th[0], NULL, issue, first);
  pthread_create(&th[1], NULL, issue, second);
  pthread_join(th[0], NULL);
  pthread_join(th[1], NULL);
  gs_set_timeout_seconds(0.0);
  CHECK(second->handshake_ok, "the first thread's collective was never queued");
  CHECK(ta.status == GS_SUCCESS, "communicator a: %s", ta.error);
  CHECK(tb.status == GS_SUCCESS, "communicator b: %s", tb.error);
  float sum_a = 0, sum_b = 0; /* each value went through two sums over the ranks */
  for (int r = 0; r < p; r++) sum_a += 1.0f + (float)r, sum_b += 10.0f * (float)(r + 1);
  if (ta.status == GS_SUCCESS && tb.status == GS_SUCCESS) {
    CHECK(first_value(&ta.x) == (float)p * sum_a, "a: %g, want %g", (double)first_value(&ta.x),
          (double)((float)p * sum_a));
    CHECK(first_value(&tb.x) == (float)p * sum_b, "b: %g, want %g", (double)first_value(&tb.x),
          (double)((float)p * sum_b));
  }
  GS_OK(gs_comm_free(&a));
  GS_OK(gs_comm_free(&b));
  gs_free(DEV, ta.x.data);
  gs_free(DEV, tb.x.data);
}

/* Work on a stream of the caller's own (behind a gate, then x += g), then
 * the ordering call, then a collective issued from the legacy default
 * stream: it must see the stream's write, which it follows only through the
 * ordering (the legacy stream does not wait for a non-blocking one). */
static void ordered_after_a_stream(gs_comm_t c) {
  int p = gs_test_size();
  uintptr_t own = emu_new_stream(1);
  for (int device_wide = 0; device_wide < 2; device_wide++) {
    SECTION("%s: later collectives follow the stream's work",
            device_wide ? "gs_cuda_order_after (the device)" : "gs_comm_cuda_order_after");
    gs_tensor_t x = device_floats(256, 1.0f), g = device_floats(256, 2.0f);
    emu_hold(own);
    GS_OK(gs_cuda_set_stream(own));
    GS_OK(gs_accumulate(&x, &g, 1, 0)); /* x becomes 3 once the gate opens */
    GS_OK(gs_cuda_set_stream(LEGACY));
    if (device_wide) GS_OK(gs_cuda_order_after(DEV.id, own));
    else GS_OK(gs_comm_cuda_order_after(c, own));
    gs_request_t r = NULL;
    GS_OK(gs_allreduce_async(c, &x, 1, GS_OP_SUM, 1.0, 1.0, &r));
    GS_OK(gs_request_wait_stream(r, LEGACY));
    emu_release();
    emu_sync(LEGACY);
    CHECK(first_value(&x) == 3.0f * (float)p, "allreduce result %g, want %d",
          (double)first_value(&x), 3 * p);
    GS_OK(gs_request_free(&r));
    emu_sync(own);
    gs_free(DEV, x.data);
    gs_free(DEV, g.data);
  }
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
  emu_nccl_launches = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_launches");
  emu_new_stream = (uintptr_t (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_stream");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && emu_sleep && emu_hold && emu_release && emu_busy && emu_sync &&
           emu_nccl_launches && emu_new_stream && provided >= MPI_THREAD_SERIALIZED;
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
  GS_OK(gs_comm_cuda_stream(c, &stream));
  comm_stream_never_blocks_legacy((uintptr_t)stream);
  request_hands_off_to_stream(c, (uintptr_t)stream);
  refused_arguments(c);
  ordered_after_a_stream(c);
  GS_OK(gs_comm_free(&c));
  opposite_issue_orders();
  SECTION("no asynchronous copy from pageable memory");
  CHECK(emu_pageable_uploads() == 0, "%ld host-to-device copies from pageable memory",
        emu_pageable_uploads());
  return gs_test_finish();
}
