/* Adasum through the C API at any rank count: the 2-rank exact cases and
 * random fused float64 lists (sizes 0, 1, odd, large) against a float64 tree
 * written here from docs/DESIGN.md section 4; results identical on every rank. Also
 * runs Adasum's memory paths under `make check-memory`. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gs_test.h"

static void pair(const double *a, const double *b, double *out, int64_t n) {
  double d = 0, A = 0, B = 0;
  for (int64_t i = 0; i < n; i++) {
    d += a[i] * b[i];
    A += a[i] * a[i];
    B += b[i] * b[i];
  }
  double ca = A >= sqrt(2.2250738585072014e-308) ? 1 - d / (2 * A) : 1;
  double cb = B >= sqrt(2.2250738585072014e-308) ? 1 - d / (2 * B) : 1;
  for (int64_t i = 0; i < n; i++) out[i] = ca * a[i] + cb * b[i];
}

/* g: p vectors of n; result in out. */
static void tree(double **g, int p, int64_t n, double *out) {
  int q = 1;
  while (q * 2 <= p) q *= 2;
  double **h = malloc((size_t)q * sizeof *h);
  for (int i = 0; i < q; i++) {
    h[i] = malloc((size_t)(n ? n : 1) * sizeof(double));
    if (i < p - q) pair(g[i], g[q + i], h[i], n);
    else memcpy(h[i], g[i], (size_t)n * sizeof(double));
  }
  for (int w = q; w > 1; w /= 2)
    for (int i = 0; i < w / 2; i++) pair(h[2 * i], h[2 * i + 1], h[i], n);
  memcpy(out, h[0], (size_t)n * sizeof(double));
  for (int i = 0; i < q; i++) free(h[i]);
  free(h);
}

int main(int argc, char **argv) {
  gs_test_init(&argc, &argv, "test_adasum");
  int rank = gs_test_rank(), size = gs_test_size();
  gs_comm_t comm = NULL;
  GS_OK(gs_comm_create(MPI_COMM_WORLD, NULL, &comm));

  if (size == 2) {
    SECTION("exact 2-rank cases");
    static const double cases[][3][2] = {{{1, 0}, {0, 1}, {1, 1}},
                                         {{1, 2}, {2, 4}, {1.5, 3}},
                                         {{0, 0}, {3, 4}, {3, 4}},
                                         {{1, 0}, {-1, 0}, {0, 0}},
                                         {{1, 1}, {1, 0}, {1.25, 0.75}}};
    for (int c = 0; c < 5; c++) {
      double x[2] = {cases[c][rank][0], cases[c][rank][1]};
      gs_tensor_t t = GS_HOST_TENSOR(x, 2, GS_FLOAT64);
      GS_OK(gs_allreduce(comm, &t, NULL, 1, GS_OP_ADASUM, 1.0, 1.0));
      CHECK(x[0] == cases[c][2][0] && x[1] == cases[c][2][1], "case %d: got [%g, %g]", c, x[0],
            x[1]);
    }
  }

  SECTION("random fused float64 lists against the tree");
  static const int64_t sizes[] = {0, 1, 7, 300, 40001}; /* 40001 doubles: a message of its own */
  enum { T = sizeof sizes / sizeof sizes[0] };
  for (int trial = 0; trial < 3; trial++) {
    double *mine[T], *got[T];
    gs_tensor_t in[T], out[T];
    for (int i = 0; i < T; i++) {
      gs_rng_t r = gs_rng_make((uint64_t)(trial * 100 + i), rank);
      mine[i] = malloc((size_t)(sizes[i] ? sizes[i] : 1) * sizeof(double));
      got[i] = malloc((size_t)(sizes[i] ? sizes[i] : 1) * sizeof(double));
      for (int64_t k = 0; k < sizes[i]; k++)
        mine[i][k] = gs_rng_unit(&r) - 0.5 + (trial == 2 ? 1.0 : 0.0);
      in[i] = GS_HOST_TENSOR(mine[i], sizes[i], GS_FLOAT64);
      out[i] = GS_HOST_TENSOR(got[i], sizes[i], GS_FLOAT64);
    }
    GS_OK(gs_allreduce(comm, in, out, T, GS_OP_ADASUM, 1.0, 1.0));
    double maxerr = 0;
    uint64_t h = 0;
    for (int i = 0; i < T; i++) {
      double **g = malloc((size_t)size * sizeof *g),
             *ref = malloc((size_t)(sizes[i] ? sizes[i] : 1) * sizeof(double));
      for (int p = 0; p < size; p++) {
        gs_rng_t r = gs_rng_make((uint64_t)(trial * 100 + i), p);
        g[p] = malloc((size_t)(sizes[i] ? sizes[i] : 1) * sizeof(double));
        for (int64_t k = 0; k < sizes[i]; k++)
          g[p][k] = gs_rng_unit(&r) - 0.5 + (trial == 2 ? 1.0 : 0.0);
      }
      tree(g, size, sizes[i], ref);
      for (int64_t k = 0; k < sizes[i]; k++) {
        double e = fabs(got[i][k] - ref[k]) / (fabs(ref[k]) + 1e-3);
        if (e > maxerr) maxerr = e;
      }
      h = gs_hash_bytes(h, got[i], (size_t)sizes[i] * sizeof(double));
      for (int p = 0; p < size; p++) free(g[p]);
      free(g);
      free(ref);
      free(mine[i]);
      free(got[i]);
    }
    CHECK(maxerr < 1e-12, "trial %d: max relative error %g", trial, maxerr);
    CHECK(gs_test_same_u64(MPI_COMM_WORLD, h), "trial %d: results differ across ranks", trial);
  }
  GS_OK(gs_comm_free(&comm));
  return gs_test_finish();
}
