/* The flight recorder's ring (gs_flight.h): fields of the calls it records
 * against the calls this test made, wraparound at a small capacity,
 * threads recording at once on their own communicators, the dump file, the
 * dump a mismatch writes, and the one SIGUSR1 asks for. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gs_test.h"

#define CAP 64
#define THREADS 4
#define PER_THREAD 50

static gs_flight_entry_t snap[CAP + 8];

static int file_has(const char *path, const char *needle, int *lines) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char line[4096];
  int found = 0;
  *lines = 0;
  while (fgets(line, sizeof line, f)) {
    if (strstr(line, "\"type\":\"call\"")) ++*lines;
    if (strstr(line, needle)) found = 1;
  }
  fclose(f);
  return found;
}

static void fields(gs_comm_t comm) {
  SECTION("fields of an allreduce, a broadcast and a barrier");
  int rank = gs_test_rank(), size = gs_test_size();
  float x[100] = {0};
  int32_t y[3] = {0};
  gs_tensor_t tx = GS_HOST_TENSOR(x, 100, GS_FLOAT32), ty = GS_HOST_TENSOR(y, 3, GS_INT32);
  uint64_t before = gs_flight_recorded();
  GS_OK(gs_allreduce(comm, &tx, &tx, 1, GS_OP_MAX, 1.0, 1.0));
  GS_OK(gs_broadcast(comm, &ty, 1, size - 1));
  GS_OK(gs_barrier(comm));
  CHECK(gs_flight_recorded() == before + 3, "recorded %llu",
        (unsigned long long)gs_flight_recorded());
  int64_t got = gs_flight_snapshot(snap, 3);
  CHECK(got == 3, "snapshot gave %lld", (long long)got);
  if (got != 3) return;
  const gs_flight_entry_t *a = &snap[0], *b = &snap[1], *c = &snap[2];
  CHECK(strcmp(a->op, "allreduce") == 0 && strcmp(b->op, "broadcast") == 0 &&
            strcmp(c->op, "barrier") == 0,
        "ops %s %s %s", a->op, b->op, c->op);
  CHECK(b->seq == a->seq + 1 && c->seq == b->seq + 1, "seqs %llu %llu %llu",
        (unsigned long long)a->seq, (unsigned long long)b->seq, (unsigned long long)c->seq);
  CHECK(a->dtype == GS_FLOAT32 && a->count == 100 && a->n == 1 && a->bytes == 400 &&
            a->redop == GS_OP_MAX && a->p2p == 0,
        "allreduce signature");
  CHECK(b->dtype == GS_INT32 && b->count == 3 && b->bytes == 12 && b->root == size - 1,
        "broadcast signature (root %d)", b->root);
  CHECK(a->status == 0 && b->status == 0 && c->status == 0, "statuses");
  CHECK(a->t_enter > 0 && a->t_enter <= a->t_valid && a->t_valid <= a->t_sent &&
            a->t_sent <= a->t_done,
        "allreduce phases in order");
  int64_t ride = 0; /* 400 bytes ride in validation over the host's shared region */
  GS_OK(gs_comm_ride_bytes(comm, &ride));
  const char *path = ride >= 400 ? "shortcut" : "mpi";
  CHECK(strcmp(a->path, path) == 0, "path %s (ride_bytes %lld)", a->path, (long long)ride);
  CHECK(a->thread == (uint64_t)syscall(SYS_gettid), "thread id");
  CHECK(a->id + 1 == b->id && b->id + 1 == c->id, "ids consecutive");
  (void)rank;
}

static void wraparound(gs_comm_t comm) {
  SECTION("wraparound: the ring keeps the last %d calls", CAP);
  CHECK(gs_flight_capacity() == CAP, "capacity %lld", (long long)gs_flight_capacity());
  double v = 1.0;
  gs_tensor_t t = GS_HOST_TENSOR(&v, 1, GS_FLOAT64);
  uint64_t before = gs_flight_recorded();
  for (int k = 0; k < 3 * CAP + 5; k++) GS_OK(gs_allreduce(comm, &t, &t, 1, GS_OP_SUM, 1.0, 1.0));
  CHECK(gs_flight_recorded() == before + 3 * CAP + 5, "recorded");
  int64_t got = gs_flight_snapshot(snap, CAP + 8);
  CHECK(got == CAP, "snapshot gave %lld of %d", (long long)got, CAP);
  for (int64_t k = 1; k < got; k++)
    CHECK(snap[k].seq == snap[k - 1].seq + 1 && snap[k].id == snap[k - 1].id + 1,
          "entry %lld follows", (long long)k);
  CHECK(got > 0 && snap[got - 1].id == gs_flight_recorded(), "the newest is the last recorded");
  CHECK(got > 0 && strcmp(snap[0].path, "shortcut") == 0, "a small allreduce rides validation");
}

typedef struct {
  gs_comm_t comm;
  uint64_t tid;
  int fails;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  w->tid = (uint64_t)syscall(SYS_gettid);
  float x[64] = {0};
  gs_tensor_t t = GS_HOST_TENSOR(x, 64, GS_FLOAT32);
  for (int k = 0; k < PER_THREAD; k++)
    if (gs_allreduce(w->comm, &t, &t, 1, GS_OP_SUM, 1.0, 1.0) != GS_SUCCESS) w->fails++;
  return NULL;
}

static void threads(void) {
  SECTION("%d threads record at once, each on its own communicator", THREADS);
  worker_t w[THREADS];
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++) {
    w[i] = (worker_t){NULL, 0, 0};
    GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &w[i].comm));
  }
  uint64_t before = gs_flight_recorded();
  for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, worker, &w[i]);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  CHECK(gs_flight_recorded() == before + THREADS * PER_THREAD, "recorded");
  int64_t got = gs_flight_snapshot(snap, CAP);
  CHECK(got == CAP, "snapshot gave %lld", (long long)got);
  uint64_t last[THREADS] = {0};
  for (int64_t k = 0; k < got; k++) {
    int i = 0;
    while (i < THREADS && snap[k].thread != w[i].tid) i++;
    CHECK(i < THREADS, "entry %lld from a worker", (long long)k);
    if (i == THREADS) continue;
    CHECK(snap[k].status == 0 && snap[k].bytes == 256, "entry %lld complete", (long long)k);
    CHECK(last[i] == 0 || snap[k].seq == last[i] + 1, "thread %d's seqs follow", i);
    last[i] = snap[k].seq;
    CHECK(k == 0 || snap[k].id == snap[k - 1].id + 1, "ids follow");
  }
  for (int i = 0; i < THREADS; i++) {
    CHECK(w[i].fails == 0, "thread %d failed", i);
    CHECK(last[i] == 0 || last[i] == PER_THREAD, "thread %d ended at #%llu", i,
          (unsigned long long)last[i]);
    gs_comm_free(&w[i].comm);
  }
}

static void dumps(gs_comm_t comm) {
  SECTION("dump files");
  char path[1200];
  snprintf(path, sizeof path, "%s", gs_flight_file());
  unlink(path);
  int lines = 0;
  GS_OK(gs_flight_dump("from the test"));
  CHECK(file_has(path, "\"reason\":\"from the test\"", &lines), "header in %s", path);
  CHECK(lines == CAP, "%d calls in the dump", lines);
  char me[64];
  snprintf(me, sizeof me, "\"type\":\"header\",\"format\":\"gradsync-flight\",\"rank\":%d,",
           gs_test_rank());
  CHECK(file_has(path, me, &lines), "header names the rank");
  if (gs_test_size() > 1) {
    SECTION("a mismatch dumps and names the file");
    float x[4] = {0};
    gs_tensor_t t = GS_HOST_TENSOR(x, 4, GS_FLOAT32);
    gs_status_t s = gs_test_rank() == 0 ? gs_allreduce(comm, &t, &t, 1, GS_OP_SUM, 1.0, 1.0)
                                        : gs_broadcast(comm, &t, 1, 0);
    CHECK(s == GS_ERR_MISMATCH, "status %d", s);
    CHECK(strstr(gs_last_error(), "flight record: ") && strstr(gs_last_error(), path),
          "error names the dump: %s", gs_last_error());
    CHECK(file_has(path, "\"reason\":\"mismatch: ", &lines), "reason mismatch");
    CHECK(file_has(path, "\"status\":\"mismatch\"", &lines), "the call's status");
  }
  SECTION("SIGUSR1 dumps from the watcher thread");
  unlink(path);
  GS_OK(gs_flight_on_signal());
  gs_test_stderr_begin(); /* the watcher says where it wrote the record */
  raise(SIGUSR1);
  struct timespec nap = {0, 1000000};
  int seen = 0;
  for (int k = 0; k < 20000 && !seen; k++) { /* bounded: 20 s at most */
    seen = file_has(path, "\"reason\":\"SIGUSR1\"", &lines);
    if (!seen) nanosleep(&nap, NULL);
  }
  CHECK(seen, "SIGUSR1 wrote %s", path);
  char said[1300];
  snprintf(said, sizeof said, "WARNING: flight record written to %s (SIGUSR1)", path);
  for (int k = 0; k < 20000 && seen && !gs_test_stderr_has(said); k++) /* after the record */
    nanosleep(&nap, NULL);
  const char *log = gs_test_stderr_end();
  CHECK_LOGGED(log, said);
}

int main(int argc, char **argv) {
  setenv("GRADSYNC_FLIGHT_ENTRIES", "64", 1);
  int provided = gs_test_init_thread(&argc, &argv, "test_flight", MPI_THREAD_MULTIPLE);
  int job = (int)getpid();
  MPI_Bcast(&job, 1, MPI_INT, 0, MPI_COMM_WORLD);
  char dir[256];
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/gs-test-flight-%d", tmp && *tmp ? tmp : "/tmp", job);
  setenv("GRADSYNC_FLIGHT_DIR", dir, 1);
  gs_comm_t comm;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));
  fields(comm);
  wraparound(comm);
  if (provided == MPI_THREAD_MULTIPLE) threads();
  dumps(comm);
  gs_comm_free(&comm);
  MPI_Barrier(MPI_COMM_WORLD);
  char file[320];
  snprintf(file, sizeof file, "%s/rank-%d.jsonl", dir, gs_test_rank());
  unlink(file);
  MPI_Barrier(MPI_COMM_WORLD);
  if (gs_test_rank() == 0) rmdir(dir);
  return gs_test_finish();
}
