// The CUDA elementwise kernels' per-thread code (src/kernels/cuda_pieces.cuh), run
// on the host for every thread of a block in turn, against gradsync's host
// kernels (libgradsync's public gs_accumulate and gs_scale), bit for bit:
// every dtype pair, in place and disjoint, random lengths, starting offsets
// and misalignments (so the 16-byte vector bodies, the scalar heads and
// tails, and the all-scalar fallback each run), block sizes 256, 32 and 7.
// No GPU and no MPI needed.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_pieces.cuh"
#include "gs_kernels.h"
#include "gs_status.h"
#include "gs_types.h"

namespace {

long failures, checks;

uint64_t state = 0x9e3779b97f4a7c15ull;
uint64_t next() {  // splitmix64
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random values with specials now and then: NaN, inf, subnormals, zeros.
void fill(gs_dtype_t dt, void *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t r = next();
    double v = ((double)(r % 20001) - 10000.0) / 997.0;
    switch (r >> 60) {
      case 0: v = NAN; break;
      case 1: v = -INFINITY; break;
      case 2: v = 1e-41; break;  // float subnormal
      case 3: v = -0.0; break;
      default: break;
    }
    switch (dt) {
      case GS_FLOAT16: ((uint16_t *)p)[i] = gs_double_to_half(v); break;
      case GS_BFLOAT16: ((uint16_t *)p)[i] = gs_double_to_bf16(v); break;
      case GS_FLOAT32: ((float *)p)[i] = (float)v; break;
      default: ((double *)p)[i] = v; break;
    }
  }
}

void check(bool ok, const char *what, int mode, int adt, int bdt, int64_t n, int nthreads) {
  checks++;
  if (ok) return;
  if (++failures <= 20)
    printf("FAILED %s: mode %d, %s <- %s, %lld elements, %d threads\n", what, mode,
           gs_dtype_name((gs_dtype_t)adt), gs_dtype_name((gs_dtype_t)bdt), (long long)n, nthreads);
}

// Runs one launch's worth of items (PIECE-sized) over the run on the host.
void run_pieces(int mode, const gs_cu_run_t &r, double scale, int nthreads) {
  const int64_t piece = 1000;  // smaller than the device's: more item boundaries
  for (int64_t f = 0; f < r.count; f += piece)
    for (int t = 0; t < nthreads; t++)
      gs_pieces::elementwise_item(mode, r, f, r.count - f < piece ? r.count - f : piece, scale, t,
                                  nthreads);
}

// One case: a (adt) and b (bdt) at byte offsets within 64-byte aligned
// buffers; in place when a is b.
void one(int mode, gs_dtype_t adt, gs_dtype_t bdt, int64_t n, int aoff, int boff, bool in_place,
         int nthreads, double scale) {
  size_t as = gs_dtype_size(adt), bs = gs_dtype_size(bdt);
  char *abuf = (char *)aligned_alloc(64, (size_t)(n + 16) * 8 + 64);
  char *bbuf = (char *)aligned_alloc(64, (size_t)(n + 16) * 8 + 64);
  char *ref = (char *)aligned_alloc(64, (size_t)(n + 16) * 8 + 64);
  void *a = abuf + aoff * as, *b = in_place ? a : (void *)(bbuf + boff * bs);
  fill(adt, a, n);
  if (!in_place) fill(bdt, b, n);
  memcpy(ref, a, (size_t)n * as);
  gs_tensor_t ta = GS_HOST_TENSOR(ref, n, adt);
  gs_tensor_t tb = GS_HOST_TENSOR(in_place ? (void *)ref : b, n, bdt);
  if (mode == GS_CU_COPY_SCALE) {  // the host: a copy of b, scaled in place
    memcpy(ref, b, (size_t)n * as);
    if (gs_scale(&ta, 1, scale) != GS_SUCCESS) check(false, "gs_scale", mode, adt, bdt, n, 0);
  } else if (gs_accumulate(&ta, &tb, 1, mode == GS_CU_OVERWRITE) != GS_SUCCESS) {
    check(false, gs_last_error(), mode, adt, bdt, n, 0);
  }
  gs_cu_run_t r = {a, b, n, (int32_t)adt, (int32_t)bdt};
  run_pieces(mode, r, scale, nthreads);
  check(memcmp(a, ref, (size_t)n * as) == 0, in_place ? "in place" : "disjoint", mode, adt, bdt,
        n, nthreads);
  free(abuf);
  free(bbuf);
  free(ref);
}

}  // namespace

int main() {
  static const gs_dtype_t fl[] = {GS_FLOAT16, GS_BFLOAT16, GS_FLOAT32, GS_FLOAT64};
  static const int threads[] = {256, 32, 7};
  for (int rep = 0; rep < 6; rep++)
    for (int mode = GS_CU_COPY_SCALE; mode <= GS_CU_OVERWRITE; mode++)
      for (gs_dtype_t adt : fl)
        for (gs_dtype_t bdt : fl) {
          if (mode == GS_CU_COPY_SCALE && adt != bdt) continue;
          int64_t n = rep == 0 ? 0 : rep == 1 ? 1 : (int64_t)(next() % 5000);
          int aoff = (int)(next() % 8), boff = (int)(next() % 8);
          if (rep == 5) aoff = boff = 0;  // both aligned: vector bodies
          int nt = threads[next() % 3];
          double scale = rep % 2 ? 1.0 : 0.3;
          one(mode, adt, bdt, n, aoff, boff, false, nt, scale);
          if (adt == bdt) one(mode, adt, bdt, n, aoff, aoff, true, nt, scale);
        }
  // zeroing and copying bits, every element size
  static const gs_dtype_t bits[] = {GS_INT8, GS_FLOAT16, GS_INT32, GS_INT64};
  for (int rep = 0; rep < 20; rep++)
    for (gs_dtype_t dt : bits) {
      size_t es = gs_dtype_size(dt);
      int64_t n = (int64_t)(next() % 3000);
      int off = (int)(next() % 16);
      char *buf = (char *)aligned_alloc(64, (size_t)(n + 16) * es + 64);
      char *src = (char *)aligned_alloc(64, (size_t)(n + 16) * es + 64);
      for (size_t k = 0; k < (size_t)(n + 16) * es; k++) src[k] = (char)next();
      memset(buf, 0x5a, (size_t)(n + 16) * es + 64);
      void *a = buf + off * es;
      gs_cu_run_t r = {a, src + (rep % 3) * es, n, (int32_t)dt, (int32_t)dt};
      run_pieces(GS_CU_COPY_SCALE, r, 1.0, threads[rep % 3]);
      check(memcmp(a, src + (rep % 3) * es, (size_t)n * es) == 0, "copy bits", 1, dt, dt, n, 0);
      check((unsigned char)buf[off * es + n * es] == 0x5a, "copy wrote past the end", 1, dt, dt, n, 0);
      run_pieces(GS_CU_ZERO, r, 1.0, threads[(rep + 1) % 3]);
      bool zero = true;
      for (int64_t k = 0; k < n * (int64_t)es; k++) zero = zero && ((char *)a)[k] == 0;
      check(zero, "zero", 0, dt, dt, n, 0);
      check(off == 0 || (unsigned char)buf[off * es - 1] == 0x5a, "zero wrote before the start",
            0, dt, dt, n, 0);
      free(buf);
      free(src);
    }
  // order keys: forward then inverse gives the value back, canonical NaN
  for (gs_dtype_t dt : fl) {
    size_t es = gs_dtype_size(dt);
    int64_t n = 4000;
    char *x = (char *)malloc((size_t)n * es), *y = (char *)malloc((size_t)n * es);
    uint64_t *keys = (uint64_t *)malloc((size_t)n * 8);
    fill(dt, x, n);
    for (int max = 0; max < 2; max++) {
      for (int64_t i = 0; i < n; i++) gs_pieces::order_key(dt, max, false, x, keys, i);
      for (int64_t i = 0; i < n; i++) gs_pieces::order_key(dt, max, true, keys, y, i);
      for (int64_t i = 0; i < n; i++) gs_pieces::order_key(dt, max, false, x, keys, i);
      for (int64_t i = 0; i < n; i++) {
        double v;
        if (dt == GS_FLOAT64) memcpy(&v, x + i * 8, 8);
        else if (dt == GS_FLOAT32) { float f; memcpy(&f, x + i * 4, 4); v = f; }
        else v = dt == GS_FLOAT16 ? gs_half_to_float(((uint16_t *)x)[i])
                                  : gs_bf16_to_float(((uint16_t *)x)[i]);
        bool same = memcmp(x + i * es, y + i * es, es) == 0;
        check(isnan(v) || same, "order key round trip", max, dt, dt, 1, 0);
      }
      // keys order like the values (NaN wins)
      for (int64_t i = 1; i < n; i++) {
        double u, w;
        auto val = [&](int64_t k) {
          if (dt == GS_FLOAT64) { double d; memcpy(&d, x + k * 8, 8); return d; }
          if (dt == GS_FLOAT32) { float f; memcpy(&f, x + k * 4, 4); return (double)f; }
          return (double)(dt == GS_FLOAT16 ? gs_half_to_float(((uint16_t *)x)[k])
                                           : gs_bf16_to_float(((uint16_t *)x)[k]));
        };
        u = val(i - 1), w = val(i);
        auto key = [&](int64_t k) { return es < 8 ? (uint64_t)((uint32_t *)keys)[k] : keys[k]; };
        uint64_t ku = key(i - 1), kw = key(i);
        if (isnan(u) || isnan(w)) continue;
        check((u < w) == (ku < kw) || u == w, "order keys order", max, dt, dt, 2, 0);
      }
    }
    free(x);
    free(y);
    free(keys);
  }
  printf("test_cuda_pieces: %ld passed, %ld failed\n", checks - failures, failures);
  return failures ? 1 : 0;
}
