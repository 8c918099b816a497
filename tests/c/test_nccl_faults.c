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
 * - an asynchronous request's device work times out in the background, and
 *   the NCCL abort that follows does not hold up another thread's call on
 *   another communicator (it runs outside the runtime lock);
 * - freeing a communicator whose collective timed out, or whose own last
 *   GPU work never finishes, neither calls ncclCommDestroy (which would
 *   wait for that work forever) nor hangs; a healthy one is finalized
 *   (ncclCommFinalize, polled) before it is destroyed.
 * Earlier the NCCL path waited with cudaStreamSynchronize under the runtime
 * lock: each of these hung. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

#include "gs_test.h"

static const gs_device_t DEV = {GS_DEVICE_CUDA, 0};
static int interrupts;
static long (*emu_destroys)(void), (*emu_finalizes)(void);
static long (*emu_aborts_started)(void), (*emu_aborts_done)(void);
static void (*emu_hold_aborts)(int on);
static int (*emu_hold)(uintptr_t stream);
static void (*emu_release)(void);

static void load_hooks(void) {
  emu_destroys = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_destroys");
  emu_finalizes = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_finalizes");
  emu_aborts_started = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_aborts_started");
  emu_aborts_done = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_aborts_done");
  emu_hold_aborts = (void (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_nccl_hold_aborts");
  emu_hold = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_hold");
  emu_release = (void (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_release");
}

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

/* What a communicator abandoned after a timeout logs: NCCL's communicator
 * aborted, then the abandoned gradsync communicator freed. */
static void check_abort_logged(const char *log) {
  CHECK_LOGGED(log,
               "ERROR: aborting the NCCL communicator (a collective took longer than "
               "its timeout)");
  CHECK_LOGGED(log,
               "WARNING: freeing a communicator abandoned after a collective took "
               "longer than its timeout");
}

/* What a rank logs when the background thread times out a handed-off
 * request on rank 0 (`seconds` as the message prints the timeout): the
 * timeout, the abort and the abandoned communicator's free on rank 0, nothing
 * on the others. */
static void check_background_timeout_logged(const char *log, int me, const char *seconds) {
  if (me != 0) {
    CHECK_NOTHING_LOGGED(log);
    return;
  }
  char timed_out[160];
  snprintf(timed_out, sizeof timed_out,
           "ERROR: gs_allreduce_async: its device work did not complete within "
           "GRADSYNC_TIMEOUT_SECONDS=%s s",
           seconds);
  CHECK_LOGGED(log, timed_out);
  check_abort_logged(log);
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
  load_hooks();
  int ok = ndev > 0 && dlsym(RTLD_DEFAULT, "gs_emulated_busy") && gs_nccl_version() > 0 &&
           emu_destroys && emu_finalizes && emu_aborts_started && emu_aborts_done &&
           emu_hold_aborts && emu_hold && emu_release && gs_test_size() > 1 &&
           provided >= MPI_THREAD_SERIALIZED;
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

  /* Each fault below is logged (the NCCL abort, an ERROR; freeing the broken
   * communicator, a WARNING): each section captures its lines and checks them. */
  SECTION("a peer that never joins: timeout");
  gs_comm_t c = nccl_comm(&t, 2.0);
  gs_test_stderr_begin();
  if (me == 0) {
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TIMEOUT);
    CHECK(strstr(gs_last_error(), "allreduce") && strstr(gs_last_error(), "TIMEOUT"), "message: %s",
          gs_last_error());
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_TIMEOUT);
    CHECK(strstr(gs_last_error(), "unusable") != NULL, "message: %s", gs_last_error());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  SECTION(
      "freeing after the timeout: no ncclCommDestroy on the aborted side, finalize on the other");
  long destroys = emu_destroys(), finalizes = emu_finalizes();
  GS_OK(gs_comm_free(&c));
  if (me == 0)
    CHECK(emu_destroys() == destroys, "ncclCommDestroy called after the collective timed out");
  else
    CHECK(emu_finalizes() == finalizes + 1 && emu_destroys() == destroys + 1,
          "a healthy communicator: %ld finalize(s) and %ld destroy(s), want 1 and 1",
          emu_finalizes() - finalizes, emu_destroys() - destroys);
  const char *log = gs_test_stderr_end();
  if (me == 0) {
    check_abort_logged(log);
  } else {
    CHECK_NOTHING_LOGGED(log);
  }

  SECTION("freeing a communicator whose last GPU work never finishes");
  c = nccl_comm(&t, 1.0);
  void *cs = NULL;
  GS_OK(gs_comm_cuda_stream(c, &cs));
  destroys = emu_destroys();
  emu_hold((uintptr_t)cs); /* a kernel its stream waits for, that never ends */
  gs_test_stderr_begin();
  GS_EXPECT(gs_comm_free(&c), GS_ERR_TIMEOUT);
  log = gs_test_stderr_end();
  check_abort_logged(log);
  CHECK(c == NULL, "the handle is released even so");
  CHECK(emu_destroys() == destroys, "ncclCommDestroy called after the last work's wait failed");
  emu_release();
  MPI_Barrier(MPI_COMM_WORLD);

  SECTION("peers that go away: NCCL's asynchronous error");
  c = nccl_comm(&t, 60.0); /* the error must come from NCCL, not the clock */
  gs_test_stderr_begin();
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
  log = gs_test_stderr_end();
  if (me == 0) {
    CHECK_LOGGED(log, "ERROR: aborting the NCCL communicator (NCCL reported an error)");
    CHECK_LOGGED(log, "WARNING: freeing a communicator abandoned after NCCL reported an error");
  } else {
    CHECK_NOTHING_LOGGED(log);
  }

  SECTION("an interrupt");
  gs_set_interrupt_check(interrupt_now);
  c = nccl_comm(&t, 60.0);
  gs_test_stderr_begin();
  if (me == 0) {
    interrupts = 1;
    GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_INTERRUPTED);
    interrupts = 0;
  }
  gs_set_interrupt_check(NULL);
  MPI_Barrier(MPI_COMM_WORLD);
  GS_OK(gs_comm_free(&c));
  log = gs_test_stderr_end();
  if (me == 0) {
    CHECK_LOGGED(log, "ERROR: aborting the NCCL communicator (a wait was interrupted");
    CHECK_LOGGED(log, "WARNING: freeing a communicator abandoned after a wait was interrupted");
  } else {
    CHECK_NOTHING_LOGGED(log);
  }

  SECTION("an asynchronous request's device work times out in the background");
  c = nccl_comm(&t, 2.0);
  gs_test_stderr_begin();
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
  log = gs_test_stderr_end();
  check_background_timeout_logged(log, me, "2");

  SECTION("the background abort does not hold up another communicator's call");
  c = nccl_comm(&t, 1.0);
  gs_test_stderr_begin();
  if (me == 0) {
    gs_comm_t self = NULL;
    GS_OK(gs_comm_create(MPI_COMM_SELF, NULL, &self));
    long started = emu_aborts_started(), done = emu_aborts_done();
    emu_hold_aborts(1); /* the abort lasts until lifted */
    gs_request_t r = NULL;
    GS_OK(gs_allreduce_async(c, &t, 1, GS_OP_SUM, 1.0, 1.0, &r));
    GS_OK(gs_request_wait_stream(r, 1)); /* the background thread watches it, times it out */
    for (int k = 0; k < 60000 && emu_aborts_started() == started; k++) usleep(1000);
    CHECK(emu_aborts_started() > started, "the timed-out request's communicator was not aborted");
    double h = 1.0;
    gs_tensor_t ht = {&h, 1, GS_FLOAT64, {GS_DEVICE_CPU, 0}};
    GS_OK(gs_allreduce(self, &ht, NULL, 1, GS_OP_SUM, 1.0, 1.0)); /* takes the runtime lock */
    CHECK(emu_aborts_done() == done, "the call on another communicator waited for the abort");
    emu_hold_aborts(0);
    int finished = 0;
    gs_status_t s = GS_SUCCESS;
    for (int k = 0; k < 600 && !finished; k++) { /* up to 60 s */
      s = gs_request_test(r, &finished);
      if (!finished) usleep(100000);
    }
    CHECK(finished && s == GS_ERR_TIMEOUT, "request: done %d, status %d (%s)", finished, (int)s,
          gs_last_error());
    GS_OK(gs_request_free(&r));
    GS_OK(gs_comm_free(&self));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  GS_OK(gs_comm_free(&c));
  log = gs_test_stderr_end();
  check_background_timeout_logged(log, me, "1");
  gs_set_timeout_seconds(0.0);
  gs_free(DEV, d);
  return gs_test_finish();
}
