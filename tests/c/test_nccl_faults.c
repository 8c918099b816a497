/* NCCL waits end in an error, never a hang. On gradsync's NCCL path (here
 * the emulated NCCL of the emulated CUDA runtime, one emulated GPU per
 * process; skipped elsewhere) rank 0 makes a collective the other ranks
 * never make, and
 * - with GRADSYNC_TIMEOUT_SECONDS set it raises GS_ERR_TIMEOUT naming the
 *   collective, the NCCL communicator is aborted and the gradsync
 *   communicator is unusable;
 * - when the peers go away (their communicators destroyed), NCCL's
 *   asynchronous error ends it with GS_ERR_NCCL, the collective's name and
 *   ncclGetLastError's text;
 * - an interrupt ends it with GS_ERR_INTERRUPTED;
 * - an asynchronous request's device work times out in the background.
 * Earlier the NCCL path waited with cudaStreamSynchronize under the runtime
 * lock: each of these hung. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

#include "gs_test.h"

static const gs_device_t DEV = {GS_DEVICE_CUDA, 0};
static int interrupts;

static int interrupt_now(void) { return interrupts; }

/* A communicator whose NCCL path is up (its first device call chose it),
 * then `timeout` set: NCCL's set-up may take seconds on a real GPU, which
 * the short limit under test must not cut. */
static gs_comm_t nccl_comm(gs_tensor_t *t, double timeout) {
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.check = 0; /* rank 0 alone reaches NCCL: no validation to meet in first */
  gs_comm_t c = NULL;
  gs_set_timeout_seconds(0.0);
  GS_OK(gs_comm_create(MPI_COMM_WORLD, &cfg, &c));
  GS_OK(gs_zero(t, 1));
  GS_OK(gs_allreduce(c, t, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  gs_set_timeout_seconds(timeout);
  return c;
}

int main(int argc, char **argv) {
  Dl_info self;
  if (dladdr((void *)&gs_allreduce, &self) && self.dli_fname) {
    setenv("GS_EMU_DISTINCT_GPUS", "1", 1);
    setenv("GRADSYNC_NCCL_LIBRARY", self.dli_fname, 1);
  }
  int provided = gs_test_init_thread(&argc, &argv, "test_nccl_faults", MPI_THREAD_SERIALIZED);
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && dlsym(RTLD_DEFAULT, "gs_emulated_busy") && gs_nccl_version() > 0 &&
           gs_test_size() > 1 && provided >= MPI_THREAD_SERIALIZED;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_nccl_faults: needs the emulated CUDA runtime and NCCL at 2+ ranks, skipped\n");
    return gs_test_finish();
  }
  int me = gs_test_rank();
  void *d = NULL;
  GS_OK(gs_malloc(DEV, 1024 * sizeof(float), &d));
  gs_tensor_t t = {d, 1024, GS_FLOAT32, DEV};

  SECTION("a peer that never joins: timeout");
  gs_comm_t c = nccl_comm(&t, 2.0);
  if (me == 0) {
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TIMEOUT);
    CHECK(strstr(gs_last_error(), "allreduce") && strstr(gs_last_error(), "TIMEOUT"), "message: %s",
          gs_last_error());
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TIMEOUT);
    CHECK(strstr(gs_last_error(), "unusable") != NULL, "message: %s", gs_last_error());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  GS_OK(gs_comm_free(&c));

  SECTION("peers that go away: NCCL's asynchronous error");
  c = nccl_comm(&t, 60.0); /* the error must come from NCCL, not the clock */
  if (me == 0) {
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_NCCL);
    CHECK(strstr(gs_last_error(), "lost its connection") != NULL,
          "message (ncclGetLastError's text expected): %s", gs_last_error());
    CHECK(strstr(gs_last_error(), "allreduce") != NULL, "message (the call's name expected): %s",
          gs_last_error());
  } else {
    usleep(200000);
    GS_OK(gs_comm_free(&c)); /* destroys this rank's NCCL communicator */
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0) GS_OK(gs_comm_free(&c));

  SECTION("an interrupt");
  gs_set_interrupt_check(interrupt_now);
  c = nccl_comm(&t, 60.0);
  if (me == 0) {
    interrupts = 1;
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INTERRUPTED);
    interrupts = 0;
  }
  gs_set_interrupt_check(NULL);
  MPI_Barrier(MPI_COMM_WORLD);
  GS_OK(gs_comm_free(&c));

  SECTION("an asynchronous request's device work times out in the background");
  c = nccl_comm(&t, 2.0);
  if (me == 0) {
    /* Two requests: the first one's timeout aborts the NCCL communicator,
     * and the second, polled after that abort, must fail the same way (it
     * once failed with GS_ERR_NCCL "aborted", a race CI hit when a caller's
     * wait polled right after the background watcher's abort). */
    gs_request_t r[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
      GS_OK(gs_allreduce_async(c, &t, 1, GS_OP_SUM, 1.0, 1.0, &r[i]));
      GS_OK(gs_request_wait_stream(r[i], 1)); /* handed to the stream: the host goes on */
    }
    for (int i = 0; i < 2; i++) {
      int done = 0;
      gs_status_t s = GS_SUCCESS;
      for (int k = 0; k < 600 && !done; k++) { /* up to 60 s */
        s = gs_request_test(r[i], &done);
        if (!done) usleep(100000);
      }
      CHECK(done && s == GS_ERR_TIMEOUT, "request %d: done %d, status %d (%s)", i, done, (int)s,
            gs_last_error());
    }
    GS_EXPECT(gs_barrier(c), GS_ERR_TIMEOUT); /* unusable: it fails at once */
    for (int i = 0; i < 2; i++) GS_OK(gs_request_free(&r[i]));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  GS_OK(gs_comm_free(&c));
  gs_set_timeout_seconds(0.0);
  gs_free(DEV, d);
  return gs_test_finish();
}
