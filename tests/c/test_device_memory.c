/* Stream-explicit device memory from C (gs_device.h), against the emulated
 * CUDA runtime, whose race checks make an access that is not ordered after
 * a conflicting write or free the sticky illegal-address error, and which
 * counts uses of destroyed streams; gates hold a stream so that "is it
 * still pending?" is a question of order (on hardware, without the hooks,
 * this test skips):
 * - gs_malloc_on / gs_free_on allocate and free in the named stream's order:
 *   a free queued behind held work on that stream waits for it;
 * - gs_mem_t records a use on a stream when it happens: the free follows the
 *   use, without touching the stream again (it may be destroyed by then);
 * - gs_mem_order makes a reader's stream follow the last write, a writer's
 *   every use, and the host (stream 0) waits;
 * - gs_mem_stream names a stream that follows the pending uses, and 0 once
 *   there are none;
 * - gradsync's device memory comes from a pool of its own: the device's
 *   default pool, shared with other libraries (CuPy's allocator, any
 *   cudaMallocAsync), keeps its attributes (its release threshold was
 *   raised to keep gradsync's memory cached). */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

static int (*emu_hold)(uintptr_t stream);
static void (*emu_release)(void);
static int (*emu_busy)(uintptr_t stream);
static int (*emu_sync)(uintptr_t stream);
static uintptr_t (*emu_stream)(int nonblocking);
static int (*emu_destroy)(uintptr_t stream);
static long (*emu_dead_uses)(void);

static const gs_device_t HOST = {GS_DEVICE_CPU, 0};
static const gs_device_t DEV = {GS_DEVICE_CUDA, 0};
#define N 512

/* Reads one float on the legacy stream (the work stream for it). */
static void read_first(void *d, float *v) {
  GS_OK(gs_cuda_set_stream(1));
  GS_OK(gs_memcpy(v, HOST, d, DEV, sizeof *v));
}

static void malloc_on_a_stream(uintptr_t s) {
  SECTION("gs_free_on frees in the named stream's order");
  float h[N];
  for (int i = 0; i < N; i++) h[i] = 2.0f;
  void *d = NULL;
  GS_OK(gs_malloc_on(DEV, sizeof h, s, &d));
  GS_OK(gs_cuda_set_stream(s));
  GS_OK(gs_memcpy(d, DEV, h, HOST, sizeof h)); /* s follows the copy */
  emu_hold(s);
  gs_tensor_t t = {d, N, GS_FLOAT32, DEV};
  GS_OK(gs_scale(&t, 1, 3.0)); /* on s, behind the gate */
  GS_OK(gs_free_on(DEV, d, s)); /* after the kernel: s's order */
  int held = emu_busy(s);
  emu_release();
  CHECK(emu_sync(s) == 0, "the kernel ran on freed memory: the free did not follow it");
  CHECK(held, "the stream was not held (the test proves nothing)");
}

static void mem_record(uintptr_t reader) {
  SECTION("gs_mem_t: a use is recorded when it happens; the free follows it");
  uintptr_t s = emu_stream(1);
  gs_mem_t m = NULL;
  GS_OK(gs_mem_alloc(DEV, N * sizeof(float), &m));
  gs_tensor_t t = {gs_mem_ptr(m), N, GS_FLOAT32, DEV};
  GS_OK(gs_mem_order(&m, 1, s, 1)); /* s follows the allocation */
  GS_OK(gs_cuda_set_stream(s));
  emu_hold(s);
  GS_OK(gs_zero(&t, 1)); /* written on s, held */
  GS_OK(gs_mem_use(&m, 1, s, 1));
  uintptr_t cai = 0;
  GS_OK(gs_mem_stream(m, &cai));
  CHECK(cai != 0, "a pending write, but gs_mem_stream says there is nothing to wait for");
  SECTION("gs_mem_order: a reader's stream follows the last write");
  GS_OK(gs_mem_order(&m, 1, reader, 0));
  int reader_waits = emu_busy(reader);
  emu_release();
  CHECK(reader_waits, "the reader's stream did not wait for the held write");
  CHECK(emu_sync(s) == 0 && emu_sync(reader) == 0, "the write failed");
  float got = -1;
  read_first(gs_mem_ptr(m), &got);
  CHECK(got == 0.0f, "read %g after the zeroing write", (double)got);
  GS_OK(gs_mem_stream(m, &cai));
  CHECK(cai == 0, "nothing pending, but gs_mem_stream names stream %p", (void *)cai);
  GS_OK(gs_cuda_set_stream(s));
  SECTION("the free touches no stream but gradsync's own");
  emu_hold(s);
  GS_OK(gs_scale(&t, 1, 2.0)); /* s is still the work stream: held again */
  GS_OK(gs_mem_use(&m, 1, s, 1));
  long before = emu_dead_uses();
  CHECK(emu_destroy(s) == 0, "could not destroy the test's stream");
  GS_OK(gs_mem_free(&m)); /* waits for the held kernel, on the memory stream */
  CHECK(m == NULL, "gs_mem_free left the handle set");
  emu_release();
  CHECK(emu_sync(1) == 0 && emu_sync(reader) == 0,
        "the kernel ran on freed memory: the free did not follow it");
  CHECK(emu_dead_uses() == before, "a destroyed stream was used");
  GS_OK(gs_cuda_set_stream(1));
}

static void host_wait(void) {
  SECTION("gs_mem_order with stream 0: the host waits for the write");
  uintptr_t s = emu_stream(1);
  gs_mem_t m = NULL;
  GS_OK(gs_mem_alloc(DEV, N * sizeof(float), &m));
  gs_tensor_t t = {gs_mem_ptr(m), N, GS_FLOAT32, DEV};
  GS_OK(gs_mem_order(&m, 1, s, 1));
  GS_OK(gs_cuda_set_stream(s));
  emu_hold(s);
  GS_OK(gs_zero(&t, 1));
  GS_OK(gs_mem_use(&m, 1, s, 1));
  emu_release(); /* the host wait below must end, not time out */
  GS_OK(gs_mem_order(&m, 1, 0, 0));
  CHECK(!emu_busy(s), "gs_mem_order(stream 0) returned before the write finished");
  GS_OK(gs_mem_free(&m));
  GS_OK(gs_cuda_set_stream(1));
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_device_memory");
  emu_hold = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_hold");
  emu_release = (void (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_release");
  emu_busy = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_busy");
  emu_sync = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_sync");
  emu_stream = (uintptr_t (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_stream");
  emu_destroy = (int (*)(uintptr_t))dlsym(RTLD_DEFAULT, "gs_emulated_stream_destroy");
  emu_dead_uses = (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_destroyed_stream_uses");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = ndev > 0 && emu_hold && emu_release && emu_busy && emu_sync && emu_stream &&
           emu_destroy && emu_dead_uses;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_device_memory: needs the emulated CUDA runtime, skipped\n");
    return gs_test_finish();
  }
  uintptr_t reader = emu_stream(1);
  malloc_on_a_stream(emu_stream(1));
  mem_record(reader);
  host_wait();
  SECTION("the device's default pool is left as it was");
  long (*pool_changes)(void) =
      (long (*)(void))dlsym(RTLD_DEFAULT, "gs_emulated_default_pool_changes");
  CHECK(pool_changes && pool_changes() == 0,
        "gradsync set %ld attributes of the device's default memory pool",
        pool_changes ? pool_changes() : -1L);
  SECTION("host memory: the record is a plain allocation");
  gs_mem_t m = NULL;
  GS_OK(gs_mem_alloc(HOST, 100, &m));
  CHECK(m && gs_mem_ptr(m), "no host memory");
  GS_OK(gs_mem_use(&m, 1, 1, 1));
  GS_OK(gs_mem_order(&m, 1, 1, 1));
  GS_OK(gs_mem_free(&m));
  return gs_test_finish();
}
