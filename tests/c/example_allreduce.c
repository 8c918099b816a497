/* gradsync from plain C: average 200 float32 gradients of mixed sizes over
 * all ranks in ONE fused message.
 *
 *   mpicc -Iinclude tests/c/example_allreduce.c -Lpyx/gradsync -lgradsync \
 *         -Wl,-rpath,$PWD/pyx/gradsync -o example && mpiexec -n 4 ./example */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <gradsync.h>

#define NTENSORS 200

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv); /* the application owns MPI, not gradsync */
  gs_comm_t comm;
  if (gs_comm_create(MPI_COMM_WORLD, NULL, &comm) != GS_SUCCESS) { /* duplicates it */
    fprintf(stderr, "gs_comm_create: %s\n", gs_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int rank, size;
  gs_comm_rank(comm, &rank);
  gs_comm_size(comm, &size);

  /* Tensor i has (i * 37) % 101 elements (0 included); rank r holds r + i. */
  float *grad[NTENSORS];
  gs_tensor_t t[NTENSORS];
  for (int i = 0; i < NTENSORS; i++) {
    int len = (i * 37) % 101;
    grad[i] = malloc(len * sizeof(float) + 1);
    for (int k = 0; k < len; k++) grad[i][k] = (float)(rank + i);
    t[i] = GS_HOST_TENSOR(grad[i], len, GS_FLOAT32);
  }

  /* In place (out = NULL): every tensor becomes the mean over ranks. */
  gs_status_t s = gs_allreduce(comm, t, NULL, NTENSORS, GS_OP_AVERAGE, 1.0, 1.0);
  if (s != GS_SUCCESS) {
    fprintf(stderr, "gs_allreduce: %s: %s\n", gs_status_string(s), gs_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  /* mean of r + i over r = 0 .. size-1 is i + (size - 1) / 2 */
  int wrong = 0;
  for (int i = 0; i < NTENSORS; i++)
    for (int k = 0; k < t[i].count; k++)
      if (fabsf(grad[i][k] - (i + (size - 1) / 2.0f)) > 1e-4f * (i + size)) wrong++;
  int all_wrong = 0;
  MPI_Allreduce(&wrong, &all_wrong, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  /* how many data messages the call sent: by MPI, or riding inside its
   * validation exchange (small calls inside one host) */
  gs_comm_stats_t st;
  gs_comm_get_stats(comm, &st);
  unsigned long long sent = st.messages + st.rode_in_check;
  if (rank == 0)
    printf("example_allreduce: averaged %d tensors over %d ranks in %llu fused message(s)%s: %s\n",
           NTENSORS, size, sent, st.rode_in_check ? " (inside the validation exchange)" : "",
           all_wrong ? "WRONG" : "ok");
  all_wrong += sent != 1;

  for (int i = 0; i < NTENSORS; i++) free(grad[i]);
  gs_comm_free(&comm);
  MPI_Finalize();
  return all_wrong != 0;
}
