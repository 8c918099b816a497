/* An outside program using an installed gradsync: built by tests/embed with
 * `pkg-config --cflags --libs gradsync` and by CMake (find_package(gradsync)),
 * run at any rank count. Rank r's element k of tensor i is a formula of
 * (r, i, k), so every rank computes the expected sums itself, in double, and
 * the values are small multiples of 1/4: float32 holds them and their sums
 * exactly. Prints "embed_allreduce: OK" on rank 0 when every rank agrees. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gradsync.h>

#define NTENSORS 5

static double value(int rank, int i, long k) {
  return (rank + 1) * 0.25 * (i + 1) + (double)((k * 7 + i) % 97) - 48.0;
}

static double sum_over_ranks(int size, int i, long k) {
  double s = 0.0;
  for (int r = 0; r < size; r++) s += value(r, i, k);
  return s;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int failures = 0;
  if (strcmp(gs_version(), GS_VERSION_STRING) != 0) {
    fprintf(stderr, "library %s, header %s\n", gs_version(), GS_VERSION_STRING);
    failures++;
  }
  gs_comm_t comm;
  if (gs_comm_create(MPI_COMM_WORLD, NULL, &comm) != GS_SUCCESS) {
    fprintf(stderr, "gs_comm_create: %s\n", gs_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int rank, size;
  gs_comm_rank(comm, &rank);
  gs_comm_size(comm, &size);

  /* float32 and float64 tensors of mixed lengths, one empty */
  static const long lengths[NTENSORS] = {1000, 0, 3, 4097, 65};
  void *data[NTENSORS];
  gs_tensor_t t[NTENSORS];
  for (int i = 0; i < NTENSORS; i++) {
    int f64 = i % 2;
    data[i] = malloc(lengths[i] * (f64 ? sizeof(double) : sizeof(float)) + 1);
    for (long k = 0; k < lengths[i]; k++) {
      if (f64) ((double *)data[i])[k] = value(rank, i, k);
      else ((float *)data[i])[k] = (float)value(rank, i, k);
    }
    t[i] = GS_HOST_TENSOR(data[i], lengths[i], f64 ? GS_FLOAT64 : GS_FLOAT32);
  }

  gs_status_t s = gs_allreduce(comm, t, NULL, NTENSORS, GS_OP_SUM, 1.0, 1.0);
  if (s != GS_SUCCESS) {
    fprintf(stderr, "gs_allreduce: %s: %s\n", gs_status_string(s), gs_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  long checked = 0;
  for (int i = 0; i < NTENSORS; i++) {
    for (long k = 0; k < lengths[i]; k++, checked++) {
      double want = sum_over_ranks(size, i, k);
      double got = i % 2 ? ((double *)data[i])[k] : ((float *)data[i])[k];
      if (got != want && failures++ < 5)
        fprintf(stderr, "rank %d: tensor %d element %ld is %.17g, not %.17g\n", rank, i, k, got,
                want);
    }
    free(data[i]);
  }
  gs_comm_free(&comm);

  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0 && total == 0)
    printf("embed_allreduce: OK, %ld elements on %d ranks, gradsync %s\n", checked, size,
           gs_version());
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
