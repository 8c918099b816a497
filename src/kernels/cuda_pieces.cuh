/* What one thread of a CUDA kernel does with its share of a work item, as
 * plain C++ templates over (thread index, thread count): cuda.cu
 * calls them with threadIdx.x and blockDim.x, and tests/c/test_cuda_pieces.cc
 * runs every thread of a block in turn on the host, so the index arithmetic
 * (vector bodies, scalar heads and tails) is checked on any machine against
 * the host kernels. The element arithmetic is half.h's, so a device result
 * has the host's bits.
 *
 * Bandwidth: the elementwise jobs move V = 16 / sizeof(acc) elements per
 * load (16-byte loads of the wider side) when both operands can be aligned
 * to their vector width at the same element, two vectors in flight per
 * thread; otherwise four scalar loads are issued before the first store. */
#ifndef GRADSYNC_CUDA_PIECES_CUH
#define GRADSYNC_CUDA_PIECES_CUH

#include <stdint.h>

#include "kernels/gs_kernels.h"
#include "base/half.h"

/* Loops over compile-time trip counts whose bodies index register arrays:
 * unrolled on the device so each index is a constant (no local memory). */
#ifdef __CUDACC__
#define GS_UNROLL _Pragma("unroll")
#else
#define GS_UNROLL
#endif

namespace gs_pieces {

/* ---- element access by dtype ------------------------------------------------- */

template <int DT>
struct Elem;
template <>
struct Elem<GS_FLOAT16> {
  typedef uint16_t T;
};
template <>
struct Elem<GS_BFLOAT16> {
  typedef uint16_t T;
};
template <>
struct Elem<GS_FLOAT32> {
  typedef float T;
};
template <>
struct Elem<GS_FLOAT64> {
  typedef double T;
};

template <int DT>
GS_HD inline float to_f(typename Elem<DT>::T v) {
  if (DT == GS_FLOAT16) return gs_half_to_float((uint16_t)v);
  if (DT == GS_BFLOAT16) return gs_bf16_to_float((uint16_t)v);
  return (float)v;
}
template <int DT>
GS_HD inline double to_d(typename Elem<DT>::T v) {
  if (DT == GS_FLOAT64) return (double)v;
  return (double)to_f<DT>(v);
}
template <int DT>
GS_HD inline typename Elem<DT>::T from_f(float f) {
  typedef typename Elem<DT>::T T;
  if (DT == GS_FLOAT16) return (T)gs_float_to_half(f);
  if (DT == GS_BFLOAT16) return (T)gs_float_to_bf16(f);
  return (T)f;
}
template <int DT>
GS_HD inline typename Elem<DT>::T from_d(double d) {
  typedef typename Elem<DT>::T T;
  if (DT == GS_FLOAT16) return (T)gs_double_to_half(d);
  if (DT == GS_BFLOAT16) return (T)gs_double_to_bf16(d);
  return (T)d;
}

/* Pointers that promise no overlap (R) where the host has checked that the
 * two operands are disjoint; in-place jobs (a == b) use plain ones. */
template <class T, bool R>
struct Ptr {
  typedef T *type;
};
template <class T>
struct Ptr<T, true> {
  typedef T *__restrict__ type;
};

/* N elements of T moved as one aligned load or store. */
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
GS_HD inline Vec<T, N> load(const void *p, int64_t i) {
  return *(const Vec<T, N> *)((const T *)p + i);
}
template <class T, int N>
GS_HD inline void store(void *p, int64_t i, const Vec<T, N> &x) {
  *(Vec<T, N> *)((T *)p + i) = x;
}

/* How many leading elements of [first, first + count) go one by one before
 * both a (element size sa) and b (sb) sit on their V-element boundaries at
 * the same element, or -1 when they never do together. */
GS_HD inline int64_t vector_head(const void *a, int sa, const void *b, int sb, int64_t first,
                                 int V) {
  uintptr_t pa = (uintptr_t)a + (uintptr_t)(first * sa);
  uintptr_t pb = (uintptr_t)b + (uintptr_t)(first * sb);
  uintptr_t wa = (uintptr_t)(V * sa), wb = (uintptr_t)(V * sb);
  if (pa % (uintptr_t)sa || pb % (uintptr_t)sb) return -1;
  int64_t h = (int64_t)(((wa - pa % wa) % wa) / (uintptr_t)sa);
  return (pb + (uintptr_t)(h * sb)) % wb == 0 ? h : -1;
}

/* ---- the elementwise jobs -------------------------------------------------------- */

/* One element of job MODE: acc is a's dtype ADT, src b's dtype BDT. */
template <int MODE, int ADT, int BDT>
GS_HD inline typename Elem<ADT>::T apply(typename Elem<ADT>::T x, typename Elem<BDT>::T y,
                                         double scale) {
  const bool wide = ADT == GS_FLOAT64 || BDT == GS_FLOAT64;
  if (MODE == GS_CU_ACCUMULATE)
    return wide ? from_d<ADT>(to_d<ADT>(x) + to_d<BDT>(y))
                : from_f<ADT>(to_f<ADT>(x) + to_f<BDT>(y));
  if (MODE == GS_CU_OVERWRITE) return wide ? from_d<ADT>(to_d<BDT>(y)) : from_f<ADT>(to_f<BDT>(y));
  /* GS_CU_COPY_SCALE, floating a == b dtype: gs_cpu_scale_copy's arithmetic */
  if (ADT == GS_FLOAT64) return from_d<ADT>(to_d<BDT>(y) * scale);
  return from_f<ADT>(to_f<BDT>(y) * (float)scale);
}

/* Elements [first, first + count) of run r, thread tid of nthreads. */
template <int MODE, int ADT, int BDT, bool R>
GS_HD void elementwise_piece(const gs_cu_run_t &r, int64_t first, int64_t count, double scale,
                             int tid, int nthreads) {
  typedef typename Elem<ADT>::T A;
  typedef typename Elem<BDT>::T B;
  constexpr int V = 16 / (int)sizeof(A);
  typename Ptr<A, R>::type a = (A *)r.a;
  typename Ptr<const B, R>::type b = (const B *)r.b;
  int64_t head = vector_head(a, sizeof(A), b, sizeof(B), first, V);
  if (head < 0 || head > count) head = count; /* all scalar */
  int64_t nvec = (count - head) / V;
  int64_t tail = head + nvec * V;
  /* scalar: the head, the tail, or everything; four loads before a store.
   * Lane u keeps its own slot (a flag, not a packed count), so every array
   * index is a constant once unrolled and the arrays live in registers: a
   * runtime index put them in local memory (a 112-byte stack on sm_90). */
  for (int64_t k0 = tid; k0 < count; k0 += 4 * (int64_t)nthreads) {
    A x[4];
    B y[4];
    bool on[4];
    GS_UNROLL
    for (int u = 0; u < 4; u++) {
      int64_t k = k0 + (int64_t)u * nthreads;
      on[u] = k < count && (k < head || k >= tail);
      x[u] = on[u] && MODE == GS_CU_ACCUMULATE ? a[first + k] : A(0);
      y[u] = on[u] ? b[first + k] : B(0);
    }
    GS_UNROLL
    for (int u = 0; u < 4; u++)
      if (on[u]) a[first + k0 + (int64_t)u * nthreads] = apply<MODE, ADT, BDT>(x[u], y[u], scale);
  }
  /* vectors: two in flight per thread */
  int64_t base = first + head;
  for (int64_t j = tid; j < nvec; j += 2 * (int64_t)nthreads) {
    int64_t j2 = j + nthreads;
    bool two = j2 < nvec;
    Vec<A, V> x0, x1;
    Vec<B, V> y0 = load<B, V>(b, base + j * V), y1;
    if (MODE == GS_CU_ACCUMULATE) x0 = load<A, V>(a, base + j * V);
    if (two) {
      y1 = load<B, V>(b, base + j2 * V);
      if (MODE == GS_CU_ACCUMULATE) x1 = load<A, V>(a, base + j2 * V);
    }
    GS_UNROLL
    for (int u = 0; u < V; u++)
      x0.v[u] = apply<MODE, ADT, BDT>(MODE == GS_CU_ACCUMULATE ? x0.v[u] : A(0), y0.v[u], scale);
    store<A, V>(a, base + j * V, x0);
    if (two) {
      GS_UNROLL
      for (int u = 0; u < V; u++)
        x1.v[u] = apply<MODE, ADT, BDT>(MODE == GS_CU_ACCUMULATE ? x1.v[u] : A(0), y1.v[u], scale);
      store<A, V>(a, base + j2 * V, x1);
    }
  }
}

/* Copies of bits (and zeroing: src NULL) as 16-byte words where the two
 * sides line up, bytes of the element size otherwise. */
template <class T>
GS_HD void bits_piece(void *dst, const void *src, int64_t first, int64_t count, int tid,
                      int nthreads) {
  constexpr int V = 16 / (int)sizeof(T);
  T *a = (T *)dst; /* copies in place are skipped by the caller */
  const T *b = (const T *)src;
  int64_t head =
      vector_head(a, sizeof(T), b ? (const void *)b : (const void *)a, sizeof(T), first, V);
  if (head < 0 || head > count) head = count;
  int64_t nvec = (count - head) / V, tail = head + nvec * V;
  for (int64_t k = tid; k < count; k += nthreads)
    if (k < head || k >= tail) a[first + k] = b ? b[first + k] : T(0);
  int64_t base = first + head;
  for (int64_t j = tid; j < nvec; j += 2 * (int64_t)nthreads) {
    int64_t j2 = j + nthreads;
    Vec<T, V> x0, x1;
    if (b) {
      x0 = load<T, V>(b, base + j * V);
      if (j2 < nvec) x1 = load<T, V>(b, base + j2 * V);
    } else {
      GS_UNROLL
      for (int u = 0; u < V; u++) x0.v[u] = x1.v[u] = T(0);
    }
    store<T, V>(a, base + j * V, x0);
    if (j2 < nvec) store<T, V>(a, base + j2 * V, x1);
  }
}

/* Element size of a gs_dtype_t, in bytes. */
GS_HD inline int dtype_bytes(int dt) {
  return dt == GS_FLOAT64 || dt == GS_INT64   ? 8
         : dt == GS_FLOAT32 || dt == GS_INT32 ? 4
         : dt == GS_INT8 || dt == GS_UINT8    ? 1
                                              : 2;
}

template <int MODE, int ADT, int BDT>
GS_HD void elementwise_alias(const gs_cu_run_t &r, int64_t first, int64_t count, double scale,
                             int tid, int nthreads) {
  /* the host allows only the same run (in place) or disjoint runs */
  if (r.a == r.b) elementwise_piece<MODE, ADT, BDT, false>(r, first, count, scale, tid, nthreads);
  else elementwise_piece<MODE, ADT, BDT, true>(r, first, count, scale, tid, nthreads);
}

template <int MODE, int ADT>
GS_HD void elementwise_by_b(const gs_cu_run_t &r, int64_t first, int64_t count, double scale,
                            int tid, int nthreads) {
  switch (r.bdtype) {
    case GS_FLOAT16:
      elementwise_alias<MODE, ADT, GS_FLOAT16>(r, first, count, scale, tid, nthreads);
      break;
    case GS_BFLOAT16:
      elementwise_alias<MODE, ADT, GS_BFLOAT16>(r, first, count, scale, tid, nthreads);
      break;
    case GS_FLOAT32:
      elementwise_alias<MODE, ADT, GS_FLOAT32>(r, first, count, scale, tid, nthreads);
      break;
    default: elementwise_alias<MODE, ADT, GS_FLOAT64>(r, first, count, scale, tid, nthreads); break;
  }
}

template <int MODE>
GS_HD void elementwise_by_a(const gs_cu_run_t &r, int64_t first, int64_t count, double scale,
                            int tid, int nthreads) {
  switch (r.adtype) {
    case GS_FLOAT16:
      elementwise_by_b<MODE, GS_FLOAT16>(r, first, count, scale, tid, nthreads);
      break;
    case GS_BFLOAT16:
      elementwise_by_b<MODE, GS_BFLOAT16>(r, first, count, scale, tid, nthreads);
      break;
    case GS_FLOAT32:
      elementwise_by_b<MODE, GS_FLOAT32>(r, first, count, scale, tid, nthreads);
      break;
    default: elementwise_by_b<MODE, GS_FLOAT64>(r, first, count, scale, tid, nthreads); break;
  }
}

template <class T>
GS_HD void bits_by_size(const gs_cu_run_t &r, const void *src, int64_t first, int64_t count,
                        int tid, int nthreads) {
  bits_piece<T>(r.a, src, first, count, tid, nthreads);
}

/* One work item of an elementwise launch, thread tid of nthreads. */
GS_HD inline void elementwise_item(int mode, const gs_cu_run_t &r, int64_t first, int64_t count,
                                   double scale, int tid, int nthreads) {
  int es = dtype_bytes(r.adtype);
  bool bits =
      mode == GS_CU_ZERO || (mode == GS_CU_COPY_SCALE && (scale == 1.0 || r.adtype >= GS_INT8));
  if (bits) { /* integers are never scaled; scale 1 copies bits */
    const void *src = mode == GS_CU_ZERO ? nullptr : r.b;
    if (src == r.a) return; /* a copy onto itself */
    if (es == 8) bits_by_size<uint64_t>(r, src, first, count, tid, nthreads);
    else if (es == 4) bits_by_size<uint32_t>(r, src, first, count, tid, nthreads);
    else if (es == 2) bits_by_size<uint16_t>(r, src, first, count, tid, nthreads);
    else bits_by_size<uint8_t>(r, src, first, count, tid, nthreads);
    return;
  }
  if (mode == GS_CU_ACCUMULATE)
    elementwise_by_a<GS_CU_ACCUMULATE>(r, first, count, scale, tid, nthreads);
  else if (mode == GS_CU_OVERWRITE)
    elementwise_by_a<GS_CU_OVERWRITE>(r, first, count, scale, tid, nthreads);
  else elementwise_by_a<GS_CU_COPY_SCALE>(r, first, count, scale, tid, nthreads);
}

/* ---- order keys: NaN-propagating min/max on integer reductions -------------------
 * A float's key is an unsigned integer that orders like the float (-0 below
 * +0); every NaN gets the key that wins the reduction (all ones for max, 0
 * for min), so an integer min/max over keys (NCCL's, which has no NaN
 * semantics to lose) gives the NaN-propagating result, and the inverse maps
 * the winning NaN key to the canonical quiet NaN that the host reduction
 * gives too. 16-bit floats take 32-bit keys, so the NaN key lies beyond
 * every float's. */
template <class U, class K>
GS_HD inline K key_of(U bits, bool is_nan, bool max) {
  const U sign = (U)((U)1 << (sizeof(U) * 8 - 1));
  if (is_nan) return max ? (K) ~(K)0 : (K)0;
  return (K)((bits & sign) ? (U)~bits : (U)(bits | sign));
}

template <class U, class K>
GS_HD inline U bits_of(K key, bool max, U canonical_nan) {
  const U sign = (U)((U)1 << (sizeof(U) * 8 - 1));
  if (key == (max ? (K) ~(K)0 : (K)0)) return canonical_nan;
  U u = (U)key;
  return (u & sign) ? (U)(u & (U)~sign) : (U)~u;
}

/* Element i: forward src (dtype) -> dst (keys), or inverse src (keys) -> dst. */
GS_HD inline void order_key(int dtype, bool max, bool inverse, const void *src, void *dst,
                            int64_t i) {
  if (dtype == GS_FLOAT64) {
    if (!inverse) {
      uint64_t u = ((const uint64_t *)src)[i];
      bool nan = (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
      ((uint64_t *)dst)[i] = key_of<uint64_t, uint64_t>(u, nan, max);
    } else {
      ((uint64_t *)dst)[i] =
          bits_of<uint64_t, uint64_t>(((const uint64_t *)src)[i], max, 0x7ff8000000000000ull);
    }
  } else if (dtype == GS_FLOAT32) {
    if (!inverse) {
      uint32_t u = ((const uint32_t *)src)[i];
      ((uint32_t *)dst)[i] = key_of<uint32_t, uint32_t>(u, (u & 0x7fffffffu) > 0x7f800000u, max);
    } else {
      ((uint32_t *)dst)[i] =
          bits_of<uint32_t, uint32_t>(((const uint32_t *)src)[i], max, 0x7fc00000u);
    }
  } else { /* float16, bfloat16: 32-bit keys */
    uint16_t inf = dtype == GS_FLOAT16 ? 0x7c00u : 0x7f80u;
    uint16_t qnan = dtype == GS_FLOAT16 ? 0x7e00u : 0x7fc0u;
    if (!inverse) {
      uint16_t u = ((const uint16_t *)src)[i];
      ((uint32_t *)dst)[i] = key_of<uint16_t, uint32_t>(u, (u & 0x7fffu) > inf, max);
    } else {
      ((uint16_t *)dst)[i] = bits_of<uint16_t, uint32_t>(((const uint32_t *)src)[i], max, qnan);
    }
  }
}

}  // namespace gs_pieces

#endif
