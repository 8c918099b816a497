/* gradsync never creates a CUDA context the caller did not have: every rank
 * works on device 1 only, from the main thread and from gradsync's
 * background thread (asynchronous collectives), and device 0's primary
 * context must never have been created. Earlier, leaving a call restored
 * "device 0" with cudaSetDevice on threads that had never chosen a device,
 * which opened a context (and its memory) on GPU 0 for every rank; and the
 * calls that name no device (pinned memory, pointer queries) ran outside
 * any context, where the runtime creates the current device's. Runs
 * against the emulated CUDA runtime with two devices (it records which
 * primary contexts were created); skips elsewhere. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

int main(int argc, char **argv) {
  int provided = gs_test_init_thread(&argc, &argv, "test_device_context", MPI_THREAD_SERIALIZED);
  int (*created)(int) = (int (*)(int))dlsym(RTLD_DEFAULT, "gs_emulated_context_created");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = created && ndev >= 2 && provided >= MPI_THREAD_SERIALIZED;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_device_context: needs the emulated CUDA runtime with 2 devices, skipped\n");
    return gs_test_finish();
  }
  SECTION("nothing touched device 0 before the test");
  CHECK(!created(0), "device 0's context existed before gradsync was used");
  const gs_device_t dev = {GS_DEVICE_CUDA, 1}, host = {GS_DEVICE_CPU, 0};
  gs_comm_t c = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &c));
  float h[257], back[257];
  for (int i = 0; i < 257; i++) h[i] = (float)(i + 1);
  void *d = NULL, *g = NULL;
  GS_OK(gs_malloc(dev, sizeof h, &d));
  GS_OK(gs_malloc(dev, sizeof h, &g));
  GS_OK(gs_memcpy(d, dev, h, host, sizeof h));
  GS_OK(gs_memcpy(g, dev, h, host, sizeof h));
  gs_tensor_t t = {d, 257, GS_FLOAT32, dev}, u = {g, 257, GS_FLOAT32, dev};
  SECTION("collectives and kernels on device 1");
  GS_OK(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0));
  GS_OK(gs_broadcast(c, &t, 1, 0));
  gs_request_t r = NULL;
  GS_OK(gs_allreduce_async(c, &t, 1, GS_OP_AVERAGE, 1.0, 1.0, &r));
  GS_OK(gs_request_wait(r));
  GS_OK(gs_request_free(&r));
  GS_OK(gs_allreduce_async(c, &t, 1, GS_OP_MAX, 1.0, 1.0, &r));
  GS_OK(gs_request_wait_stream(r, 1));
  GS_OK(gs_request_free(&r));
  GS_OK(gs_accumulate(&t, &u, 1, 0));
  int finite = 0;
  GS_OK(gs_all_finite(&t, 1, &finite));
  GS_OK(gs_memcpy(back, host, d, dev, sizeof back));
  int p = gs_test_size();
  /* sum, broadcast, average, max: 8p; then + 8 */
  CHECK(back[7] == 8.0f * (float)p + 8.0f, "result %g", (double)back[7]);
  GS_OK(gs_free(dev, d));
  GS_OK(gs_free(dev, g));
  SECTION("pinned memory and pointer queries name no device");
  const gs_device_t pinned = {GS_DEVICE_CUDA_HOST, 0};
  void *ph = NULL;
  GS_OK(gs_malloc(pinned, 4096, &ph));
  gs_device_t where = {GS_DEVICE_CPU, 0};
  GS_OK(gs_pointer_device(ph, &where));
  CHECK(where.kind == GS_DEVICE_CUDA_HOST, "pinned memory reported as kind %d", (int)where.kind);
  GS_OK(gs_free(pinned, ph));
  GS_OK(gs_pointer_device(h, &where));
  CHECK(where.kind == GS_DEVICE_CPU, "stack memory reported as kind %d", (int)where.kind);
  GS_OK(gs_comm_free(&c));
  SECTION("device 0 still has no context");
  CHECK(created(1), "device 1's context was never created (the test did not run there?)");
  CHECK(!created(0), "gradsync created a context on device 0, which this process never used");
  return gs_test_finish();
}
