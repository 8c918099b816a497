/* The kernel-table ring (src/device/ring.c) against the emulated CUDA runtime,
 * whose gates hold a stream busy until the test opens them (on hardware,
 * without the hooks, this test skips). Each section is judged by order:
 * launches must return while a gate is still closed, and the values must
 * be right once it opens.
 * - mirror: the ring's device memory is usable on a stream other than the
 *   one that first needed it, while that one is held (its allocation is
 *   ordered before every stream's use);
 * - reader: while one thread waits for gs_all_finite's answer on a held
 *   stream, another thread launches a kernel whose table is larger than
 *   the ring; both complete (the ring used to spin on the reader's region
 *   holding its lock, and the reader then blocked on that lock: a hang);
 * - queued-reader: 3000 small launches queue behind a gate while a reader
 *   waits (the ring used to fail with "full of results not yet read");
 * - queued: 6000 small launches queue behind a gate (the ring used to wait
 *   on the host for the gated work);
 * - bound: past its bound the ring waits for room, polling with its lock
 *   released (it used to wait holding it), and times out while a gate
 *   stays closed.
 * `test_device_ring SECTION,...` runs only the sections named. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

#include "gs_test.h"

static int (*emu_hold)(uintptr_t stream);
static void (*emu_release)(void);
static int (*emu_sync)(uintptr_t stream);
static uintptr_t (*emu_stream)(int nonblocking);
static long (*emu_queued)(uintptr_t stream);
static long (*emu_gates_passed)(void);
static long (*emu_event_queries)(void);

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static const gs_device_t DEV = {GS_DEVICE_CUDA, 0};

static float *floats(int64_t n, float value) {
  float *h = malloc((size_t)n * sizeof *h);
  for (int64_t i = 0; i < n; i++) h[i] = value;
  return h;
}

/* Allocated and filled on the legacy default stream, then waited for: an
 * upload from pageable memory returns with its DMA still queued there, and
 * the sections' held streams are not ordered after it. */
static gs_tensor_t to_device(const float *h, int64_t n) {
  void *d = NULL;
  gs_cuda_set_stream(1);
  GS_OK(gs_malloc(DEV, (size_t)n * sizeof(float), &d));
  GS_OK(gs_memcpy(d, DEV, h, HOST, (size_t)n * sizeof(float)));
  CHECK(emu_sync(1) == 0, "the upload failed");
  return (gs_tensor_t){d, n, GS_FLOAT32, DEV};
}

/* How many elements of the device tensor differ from want[] (the first printed). */
static int64_t mismatches(const gs_tensor_t *t, const float *want) {
  float *h = floats(t->count, 0);
  GS_OK(gs_memcpy(h, HOST, t->data, DEV, (size_t)t->count * sizeof(float)));
  int64_t bad = 0;
  for (int64_t i = 0; i < t->count; i++)
    if (h[i] != want[i] && bad++ == 0)
      fprintf(stderr, "element %lld is %g, want %g\n", (long long)i, h[i], want[i]);
  free(h);
  return bad;
}

/* A thread waiting for gs_all_finite's answer on a held stream. */
typedef struct reader {
  uintptr_t stream;
  gs_tensor_t t;
  int finite;
  gs_status_t status;
  pthread_t thread;
} reader_t;

static void *read_finite(void *arg) {
  reader_t *r = arg;
  gs_cuda_set_stream(r->stream);
  r->status = gs_all_finite(&r->t, 1, &r->finite);
  return NULL;
}

/* Starts a reader on `stream` (held) over a tensor with a NaN, and returns
 * once its table, kernel and result copy are queued: its table is then in
 * the ring (the ring's lock is held from open to close). */
static void start_reader(reader_t *r, uintptr_t stream) {
  float *h = floats(1000, 1.0f);
  h[500] = NAN;
  *r = (reader_t){stream, to_device(h, 1000), -1, GS_SUCCESS, 0};
  free(h);
  long before = emu_queued(stream);
  pthread_create(&r->thread, NULL, read_finite, r);
  struct timespec nap = {0, 100000};
  for (long i = 0; i < 600000 && emu_queued(stream) < before + 3; i++) nanosleep(&nap, NULL);
  CHECK(emu_queued(stream) >= before + 3, "the reader queued no work");
}

static void finish_reader(reader_t *r) {
  pthread_join(r->thread, NULL);
  CHECK(r->status == GS_SUCCESS, "gs_all_finite: %d (%s)", (int)r->status, gs_last_error());
  CHECK(r->finite == 0, "gs_all_finite missed the NaN: %d", r->finite);
  gs_free(DEV, r->t.data);
}

static void mirror(uintptr_t held, uintptr_t other) {
  SECTION("mirror: the ring's device memory is ordered before every stream's use");
  float *h = floats(256, 1.0f), *want = floats(256, 2.0f);
  gs_tensor_t x = to_device(h, 256), y = to_device(h, 256);
  long gates = emu_gates_passed();
  emu_hold(held);
  gs_cuda_set_stream(held); /* the ring's first table */
  GS_OK(gs_scale(&x, 1, 2.0));
  gs_cuda_set_stream(other);
  GS_OK(gs_scale(&y, 1, 2.0));
  CHECK(emu_sync(other) == 0, "the other stream failed (sticky error)");
  CHECK(emu_gates_passed() == gates, "the held stream ran before its gate was opened");
  emu_release();
  CHECK(emu_sync(held) == 0, "the held stream failed");
  CHECK(mismatches(&y, want) == 0, "y on the other stream");
  CHECK(mismatches(&x, want) == 0, "x on the held stream");
  gs_free(DEV, x.data);
  gs_free(DEV, y.data);
  free(h);
  free(want);
}

/* n tensors of 4 floats in one buffer: one table of n runs and n items. */
static void reader_and_large_table(uintptr_t held, int64_t n) {
  SECTION("reader: a thread waits for all_finite while another launches %lld tensors",
          (long long)n);
  reader_t r;
  float *h = floats(4 * n, 0), *want = floats(4 * n, 0);
  for (int64_t i = 0; i < 4 * n; i++) h[i] = (float)(i % 7 + 1), want[i] = 2 * h[i];
  gs_tensor_t all = to_device(h, 4 * n);
  gs_tensor_t *views = malloc((size_t)n * sizeof *views);
  for (int64_t k = 0; k < n; k++)
    views[k] = (gs_tensor_t){(float *)all.data + 4 * k, 4, GS_FLOAT32, DEV};
  long gates = emu_gates_passed();
  emu_hold(held);
  start_reader(&r, held);
  gs_cuda_set_stream(held);
  GS_OK(gs_scale(views, n, 2.0));
  CHECK(emu_gates_passed() == gates, "the launch waited for the held stream");
  emu_release();
  finish_reader(&r);
  CHECK(emu_sync(held) == 0, "the held stream failed");
  CHECK(mismatches(&all, want) == 0, "the %lld tensors scaled by 2", (long long)n);
  gs_free(DEV, all.data);
  free(views);
  free(h);
  free(want);
}

/* `launches` gs_scale calls behind a gate, launch k on tensor k % 10 by
 * 2^(+1, +1, -1 by turns): each tensor ends at (t + 1) * 2^(its net
 * exponent), so a table reused too early, a lost or a repeated launch shows. */
static void queued(uintptr_t held, int launches, int with_reader) {
  SECTION("%s: %d launches queued behind a gate", with_reader ? "queued-reader" : "queued",
          launches);
  enum { T = 10 };
  gs_tensor_t x[T];
  float *want[T];
  int net[T] = {0};
  for (int t = 0; t < T; t++) {
    float *h = floats(100 + 37 * t, (float)(t + 1));
    x[t] = to_device(h, 100 + 37 * t);
    free(h);
  }
  reader_t r;
  long gates = emu_gates_passed();
  emu_hold(held);
  if (with_reader) start_reader(&r, held);
  gs_cuda_set_stream(held);
  int failed = 0;
  for (int k = 0; k < launches; k++) {
    int up = (k / T) % 3 != 2;
    net[k % T] += up ? 1 : -1;
    if (gs_scale(&x[k % T], 1, up ? 2.0 : 0.5) != GS_SUCCESS && failed++ == 0)
      CHECK(0, "launch %d failed: %s", k, gs_last_error());
  }
  CHECK(failed == 0, "%d of %d launches failed", failed, launches);
  CHECK(emu_gates_passed() == gates, "a launch waited for the held stream");
  emu_release();
  if (with_reader) finish_reader(&r);
  CHECK(emu_sync(held) == 0, "the held stream failed");
  for (int t = 0; t < T; t++) {
    want[t] = floats(x[t].count, ldexpf((float)(t + 1), net[t]));
    CHECK(mismatches(&x[t], want[t]) == 0, "tensor %d", t);
    gs_free(DEV, x[t].data);
    free(want[t]);
  }
}

/* A thread scaling a list of tensors by 2 on `stream`. */
typedef struct launcher {
  uintptr_t stream;
  gs_tensor_t *views;
  int64_t n;
  gs_status_t status;
  int done;
  pthread_t thread;
} launcher_t;

static void *launch(void *arg) {
  launcher_t *l = arg;
  gs_cuda_set_stream(l->stream);
  l->status = gs_scale(l->views, l->n, 2.0);
  __atomic_store_n(&l->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* n one-float tensors: a table of 56 n bytes. */
static gs_tensor_t *views_of(gs_tensor_t all) {
  gs_tensor_t *v = malloc((size_t)all.count * sizeof *v);
  for (int64_t k = 0; k < all.count; k++)
    v[k] = (gs_tensor_t){(float *)all.data + k, 1, GS_FLOAT32, DEV};
  return v;
}

/* Two tables of 8.5 MiB cannot both be in flight under the ring's 16 MiB
 * bound: the second waits, polling, with the ring's lock released (a small
 * launch on another thread goes through meanwhile), completes once the
 * first has run, and ends in a timeout while the gate stays closed. */
static void bound(uintptr_t held, uintptr_t other) {
  SECTION("bound: past the ring's bound a launch waits without holding the ring");
  const int64_t n = 160000;
  float *h = floats(n, 1.0f), *want = floats(n, 0), *two = floats(16, 2.0f);
  gs_tensor_t all = to_device(h, n), small = to_device(h, 16);
  gs_tensor_t *views = views_of(all);
  const char *env = getenv("GRADSYNC_TIMEOUT_SECONDS");
  gs_set_timeout_seconds(60); /* tells a hang from a wait the release ends */
  long gates = emu_gates_passed();
  emu_hold(held);
  gs_cuda_set_stream(held);
  GS_OK(gs_scale(views, n, 2.0));
  launcher_t w = {held, views, n, GS_SUCCESS, 0, 0};
  long queries = emu_event_queries();
  pthread_create(&w.thread, NULL, launch, &w);
  struct timespec nap = {0, 100000};
  for (long i = 0; i < 600000 && emu_event_queries() < queries + 1000; i++) nanosleep(&nap, NULL);
  gs_cuda_set_stream(other); /* while the thread polls for room */
  GS_OK(gs_scale(&small, 1, 2.0));
  CHECK(!__atomic_load_n(&w.done, __ATOMIC_ACQUIRE),
        "a small launch waited for the thread waiting for room in the ring");
  CHECK(emu_gates_passed() == gates, "the held stream ran before its gate was opened");
  emu_release();
  pthread_join(w.thread, NULL);
  CHECK(w.status == GS_SUCCESS, "the waiting launch: %d", (int)w.status);

  SECTION("bound: a launch waiting for room behind a closed gate times out");
  emu_hold(held);
  gs_cuda_set_stream(held);
  GS_OK(gs_scale(views, n, 2.0));
  gs_set_timeout_seconds(1);
  GS_EXPECT(gs_scale(views, n, 2.0), GS_ERR_TIMEOUT);
  CHECK_ERROR_MENTIONS("kernel table ring");
  gs_set_timeout_seconds(env ? atof(env) : 0);
  emu_release();
  CHECK(emu_sync(held) == 0 && emu_sync(other) == 0, "a stream failed");
  for (int64_t i = 0; i < n; i++) want[i] = 8.0f; /* three launches ran, the fourth never did */
  CHECK(mismatches(&all, want) == 0, "the large tables' tensors");
  CHECK(mismatches(&small, two) == 0, "the small launch's tensor");
  gs_free(DEV, all.data);
  gs_free(DEV, small.data);
  free(views);
  free(h);
  free(want);
  free(two);
}

static int chosen(const char *only, const char *name) {
  if (!only) return 1;
  size_t n = strlen(name);
  for (const char *p = strstr(only, name); p; p = strstr(p + 1, name))
    if ((p == only || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
  return 0;
}

int main(int argc, char **argv) {
  int provided = gs_test_init_thread(&argc, &argv, "test_device_ring", MPI_THREAD_SERIALIZED);
  const char *only = argc > 1 ? argv[1] : NULL;
  emu_hold = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_hold");
  emu_release = (void (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_release");
  emu_sync = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_sync");
  emu_stream = (uintptr_t (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_stream");
  emu_queued = (long (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_queued");
  emu_gates_passed = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_gates_passed");
  emu_event_queries = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_event_queries");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && emu_hold && emu_release && emu_sync && emu_stream && emu_queued &&
           emu_gates_passed && emu_event_queries && provided >= MPI_THREAD_SERIALIZED;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0) printf("test_device_ring: needs the emulated CUDA runtime, skipped\n");
    return gs_test_finish();
  }
  uintptr_t held = emu_stream(1), other = emu_stream(1);
  /* in this order: the ring is at its first size (1 MiB) for the reader's
   * large table (20000 runs and items: 1.1 MiB), and the plain queue outgrows
   * what the reader's section left */
  if (chosen(only, "mirror")) mirror(held, other);
  if (chosen(only, "reader")) reader_and_large_table(held, 20000);
  if (chosen(only, "queued-reader")) queued(held, 3000, 1);
  if (chosen(only, "queued")) queued(held, 6000, 0);
  if (chosen(only, "bound")) bound(held, other);
  gs_cuda_set_stream(1);
  return gs_test_finish();
}
