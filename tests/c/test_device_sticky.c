/* A sticky CUDA error (illegal address, launch failure: the process's CUDA
 * context is lost) during a collective fails that collective with a message
 * that says so, and leaves the communicator unusable: later calls fail at
 * once instead of queueing work on a dead context. The error is injected
 * into gradsync's communication stream through the emulated CUDA runtime's
 * hook (this test skips elsewhere); the whole process's context is lost
 * afterwards, so this runs in a process of its own. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "gs_test.h"

#define ILLEGAL_ADDRESS 700 /* cudaErrorIllegalAddress */

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_device_sticky");
  int (*fault)(uintptr_t, int) = (int (*)(uintptr_t, int))dlsym(RTLD_DEFAULT, "gs_emulated_fault");
  int ndev = 0;
  GS_OK(gs_cuda_device_count(&ndev));
  int ok = fault && ndev > 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    if (gs_test_rank() == 0)
      printf("test_device_sticky: needs the emulated CUDA runtime, skipped\n");
    return gs_test_finish();
  }
  const gs_device_t dev = {GS_DEVICE_CUDA, 0};
  gs_comm_t c = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &c));
  void *d = NULL;
  GS_OK(gs_malloc(dev, 4096, &d));
  gs_tensor_t t = {d, 1024, GS_FLOAT32, dev};
  GS_OK(gs_zero(&t, 1));
  GS_OK(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0)); /* the device path is chosen */
  void *stream = NULL;
  GS_OK(gs_comm_cuda_stream(c, &stream));
  SECTION("a sticky error during a collective");
  fault((uintptr_t)stream, ILLEGAL_ADDRESS);
  GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_CUDA);
  CHECK(strstr(gs_last_error(), "sticky") && strstr(gs_last_error(), "illegal memory access"),
        "message: %s", gs_last_error());
  SECTION("the communicator is unusable afterwards");
  GS_EXPECT(gs_allreduce(c, &t, NULL, 1, GS_OP_SUM, 1.0, 1.0), GS_ERR_CUDA);
  CHECK(strstr(gs_last_error(), "unusable") != NULL, "message: %s", gs_last_error());
  GS_EXPECT(gs_barrier(c), GS_ERR_CUDA);
  gs_test_stderr_begin();
  GS_OK(gs_comm_free(&c)); /* a broken communicator can still be freed */
  const char *log = gs_test_stderr_end();
  CHECK_LOGGED(log,
               "WARNING: freeing a communicator abandoned after the CUDA runtime reported "
               "an error");
  return gs_test_finish();
}
