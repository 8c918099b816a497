// gradsync's collectives as XLA FFI handlers: what gradsync.jax lowers its
// calls to inside jax.jit (docs/decisions/jax.md). A binding layer above the
// C library, as the Cython extension is: it reads the buffers XLA hands it
// into gs_tensor_t lists and calls the public C API (include/) on the
// communicator whose gs_comm_t arrives as the int64 attribute `comm`.
//
// Every handler takes an ordering token first and returns one first (JAX's
// ordered effect: the calls of one program run in program order on every
// rank), then the inputs and the results, one per array of the pytree (one
// fused call). A failure returns an FFI error whose message starts with
// "[gradsync status=N] ", N the gs_status_t, then the operation and
// gs_last_error(): gradsync.jax maps it back onto gradsync's error classes.
//
// Built only when jax is importable at build time (setup.py), against the
// header-only API of jax.ffi.include_dir(). Each collective has a CPU handler
// and a CUDA one (GsJax*Cuda): the CUDA handler makes XLA's stream the
// thread's work stream (gs_cuda_set_stream), so gradsync's call is ordered
// after the work XLA queued before it, and returns once its results are in
// place (the host waits, as gradsync's blocking collectives do: the
// asynchronous form on XLA's stream is the next step, once a GPU can test it).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gradsync.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error failed(const char *call, gs_status_t s) {
  const char *detail = gs_last_error();
  std::string msg = "[gradsync status=" + std::to_string(static_cast<int>(s)) + "] " + call +
                    " inside jax.jit: " + (detail && *detail ? detail : gs_status_string(s));
  ffi::ErrorCode code = s == GS_ERR_INVALID_ARGUMENT || s == GS_ERR_TYPE
                            ? ffi::ErrorCode::kInvalidArgument
                        : s == GS_ERR_TIMEOUT     ? ffi::ErrorCode::kDeadlineExceeded
                        : s == GS_ERR_UNSUPPORTED ? ffi::ErrorCode::kUnimplemented
                                                  : ffi::ErrorCode::kInternal;
  return ffi::Error(code, msg);
}

bool dtype_of(ffi::DataType t, gs_dtype_t *out) {
  switch (t) {
    case ffi::DataType::F16: *out = GS_FLOAT16; return true;
    case ffi::DataType::BF16: *out = GS_BFLOAT16; return true;
    case ffi::DataType::F32: *out = GS_FLOAT32; return true;
    case ffi::DataType::F64: *out = GS_FLOAT64; return true;
    case ffi::DataType::S8: *out = GS_INT8; return true;
    case ffi::DataType::U8: *out = GS_UINT8; return true;
    case ffi::DataType::S32: *out = GS_INT32; return true;
    case ffi::DataType::S64: *out = GS_INT64; return true;
    default: return false;
  }
}

// A zero-element buffer may come without memory; gradsync wants a pointer.
alignas(64) char empty_storage[64];

// Where a call's buffers are: host memory, or CUDA memory of one device with
// the stream XLA runs the call on.
struct Where {
  gs_device_t device;
  void *stream;
};

constexpr Where kHost = {{GS_DEVICE_CPU, 0}, nullptr};

// Makes XLA's stream the thread's work stream for one call (CUDA), then
// puts back the one the thread had.
class WorkStream {
 public:
  explicit WorkStream(const Where &w) : set_(w.device.kind == GS_DEVICE_CUDA) {
    if (set_) {
      before_ = gs_cuda_get_stream();
      gs_cuda_set_stream(reinterpret_cast<uintptr_t>(w.stream));
    }
  }
  ~WorkStream() {
    if (set_) gs_cuda_set_stream(before_);
  }

 private:
  bool set_;
  uintptr_t before_ = 0;
};

ffi::Error tensor_of(const char *call, const ffi::AnyBuffer &b, const Where &w, gs_tensor_t *t,
                     int64_t *rows) {
  gs_dtype_t dt;
  if (!dtype_of(b.element_type(), &dt)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("[gradsync status=2] ") + call +
                          " inside jax.jit: an array's dtype is not one gradsync reduces");
  }
  int64_t count = static_cast<int64_t>(b.element_count());
  *t = gs_tensor_t{count ? b.untyped_data() : empty_storage, count, dt, w.device};
  auto dims = b.dimensions();
  if (rows) *rows = dims.size() ? dims[0] : 1;
  return ffi::Error::Success();
}

// The n inputs and n results as gs_tensor_t lists (rows: each input's dim 0).
ffi::Error tensors(const char *call, const Where &w, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, std::vector<gs_tensor_t> *in,
                   std::vector<gs_tensor_t> *out, std::vector<int64_t> *rows) {
  size_t n = args.size();
  if (rets.size() != n) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("[gradsync status=7] ") + call + ": inputs and results differ");
  }
  in->resize(n);
  out->resize(n);
  rows->resize(n);
  for (size_t i = 0; i < n; i++) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    int64_t unused;
    ffi::Error e = tensor_of(call, *a, w, &(*in)[i], &(*rows)[i]);
    if (e.failure()) return e;
    e = tensor_of(call, **r, w, &(*out)[i], &unused);
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

gs_comm_t comm_of(int64_t handle) {
  return reinterpret_cast<gs_comm_t>(static_cast<intptr_t>(handle));
}

ffi::Error allreduce(const Where &w, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm,
                     int64_t op, double prescale, double postscale, int64_t wire) {
  std::vector<gs_tensor_t> in, out;
  std::vector<int64_t> rows;
  ffi::Error e = tensors("allreduce", w, args, rets, &in, &out, &rows);
  if (e.failure()) return e;
  int64_t n = static_cast<int64_t>(in.size());
  gs_op_t cop = static_cast<gs_op_t>(op);
  gs_status_t s =
      wire == GS_WIRE_NONE
          ? gs_allreduce(comm_of(comm), in.data(), out.data(), n, cop, prescale, postscale)
          : gs_allreduce_wire(comm_of(comm), in.data(), out.data(), n, cop, prescale, postscale,
                              static_cast<gs_wire_t>(wire), nullptr);
  return s == GS_SUCCESS ? ffi::Error::Success() : failed("allreduce", s);
}

// Broadcast in place on the results, which hold this rank's inputs: XLA
// aliases each result to its input (gradsync.jax's lowering), a copy is made
// only where it did not.
ffi::Error broadcast(const Where &w, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm,
                     int64_t root) {
  std::vector<gs_tensor_t> in, out;
  std::vector<int64_t> rows;
  ffi::Error e = tensors("broadcast", w, args, rets, &in, &out, &rows);
  if (e.failure()) return e;
  for (size_t i = 0; i < in.size(); i++) {
    if (out[i].data == in[i].data || !in[i].count) continue;
    if (w.device.kind != GS_DEVICE_CPU) {
      return ffi::Error(ffi::ErrorCode::kInternal,
                        "[gradsync status=7] broadcast inside jax.jit: a result is not its "
                        "input's buffer");
    }
    std::memcpy(out[i].data, in[i].data, in[i].count * gs_dtype_size(in[i].dtype));
  }
  gs_status_t s = gs_broadcast(comm_of(comm), out.data(), static_cast<int64_t>(out.size()),
                               static_cast<int>(root));
  return s == GS_SUCCESS ? ffi::Error::Success() : failed("broadcast", s);
}

// A call whose counts are per rank and per array (allgather, alltoall): its
// tensors, the communicator's size and a size x n table of counts (zeros).
struct PerRank {
  std::vector<gs_tensor_t> in, out;
  std::vector<int64_t> rows, counts;
  int size = 0;
  int64_t n = 0;
};

ffi::Error per_rank(const char *call, const Where &w, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, int64_t comm, PerRank *p) {
  ffi::Error e = tensors(call, w, args, rets, &p->in, &p->out, &p->rows);
  if (e.failure()) return e;
  gs_status_t s = gs_comm_size(comm_of(comm), &p->size);
  if (s != GS_SUCCESS) return failed(call, s);
  p->n = static_cast<int64_t>(p->in.size());
  p->counts.assign(static_cast<size_t>(p->size) * p->n, 0);
  return ffi::Error::Success();
}

// Every rank's arrays concatenated along dim 0. The results' shapes were fixed
// when JAX traced the call (every rank's dim 0 equal to this rank's): the
// counts are exchanged first, and a rank whose dim 0 differs fails every rank.
ffi::Error allgather(const Where &w, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     int64_t comm) {
  PerRank p;
  ffi::Error e = per_rank("allgather", w, args, rets, comm, &p);
  if (e.failure()) return e;
  int64_t n = p.n;
  gs_status_t s = gs_allgather_counts(comm_of(comm), p.in.data(), n, nullptr, p.counts.data());
  if (s != GS_SUCCESS) return failed("allgather", s);
  for (int r = 0; r < p.size; r++) {
    for (int64_t i = 0; i < n; i++) {
      if (p.counts[r * n + i] == p.in[i].count) continue;
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "[gradsync status=3] allgather inside jax.jit: rank " + std::to_string(r) +
                            " has " + std::to_string(p.counts[r * n + i]) + " elements in x[" +
                            std::to_string(i) + "], this rank " + std::to_string(p.in[i].count) +
                            " (inside jit every rank's arrays must have one shape)");
    }
  }
  s = gs_allgatherv(comm_of(comm), p.in.data(), p.out.data(), n, p.counts.data());
  return s == GS_SUCCESS ? ffi::Error::Success() : failed("allgather", s);
}

ffi::Error reduce_scatter(const Where &w, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          int64_t comm, int64_t op, double prescale, double postscale) {
  std::vector<gs_tensor_t> in, out;
  std::vector<int64_t> rows;
  ffi::Error e = tensors("reduce_scatter", w, args, rets, &in, &out, &rows);
  if (e.failure()) return e;
  gs_status_t s =
      gs_reduce_scatter(comm_of(comm), in.data(), out.data(), static_cast<int64_t>(in.size()),
                        rows.data(), static_cast<gs_op_t>(op), prescale, postscale);
  return s == GS_SUCCESS ? ffi::Error::Success() : failed("reduce_scatter", s);
}

// Block r of dim 0 of each array to rank r, the blocks received in rank
// order: equal blocks (gradsync.jax checked at trace time that dim 0 divides
// by the rank count), so every count is known without an exchange.
ffi::Error alltoall(const Where &w, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    int64_t comm) {
  PerRank p;
  ffi::Error e = per_rank("alltoall", w, args, rets, comm, &p);
  if (e.failure()) return e;
  for (int r = 0; r < p.size; r++)
    for (int64_t i = 0; i < p.n; i++) p.counts[r * p.n + i] = p.in[i].count / p.size;
  gs_status_t s =
      gs_alltoallv(comm_of(comm), p.in.data(), p.out.data(), p.n, p.counts.data(), p.counts.data());
  return s == GS_SUCCESS ? ffi::Error::Success() : failed("alltoall", s);
}

// The two entry points of each collective: host buffers, and CUDA buffers on
// XLA's stream of device `ordinal`.
template <auto Impl, typename... Attrs>
ffi::Error on_host(ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                   ffi::RemainingRets rets, Attrs... attrs) {
  return Impl(kHost, args, rets, attrs...);
}

template <auto Impl, typename... Attrs>
ffi::Error on_cuda(void *stream, int32_t ordinal, ffi::Token, ffi::RemainingArgs args,
                   ffi::Result<ffi::Token>, ffi::RemainingRets rets, Attrs... attrs) {
  Where w = {{GS_DEVICE_CUDA, ordinal}, stream};
  WorkStream on_xla_stream(w);
  return Impl(w, args, rets, attrs...);
}

}  // namespace

// The handlers are the library's only exported symbols (-fvisibility=hidden).
#define GS_JAX_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error *name(XLA_FFI_CallFrame *)

// The token, the inputs, the token, the results; then the attributes.
#define GS_JAX_BUFFERS .Arg<ffi::Token>().RemainingArgs().Ret<ffi::Token>().RemainingRets()

// GsJax<name> (CPU) and GsJax<name>Cuda, over `impl`, whose attributes are
// bound by ATTRS and have the types that follow.
#define GS_JAX_HANDLERS(name, impl, ATTRS, ...)                                     \
  GS_JAX_HANDLER(name);                                                             \
  GS_JAX_HANDLER(name##Cuda);                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (on_host<impl, __VA_ARGS__>),                 \
                                ffi::Ffi::Bind() GS_JAX_BUFFERS ATTRS);             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                    \
      name##Cuda, (on_cuda<impl, __VA_ARGS__>),                                     \
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void *>>().Ctx<ffi::DeviceOrdinal>() \
          GS_JAX_BUFFERS ATTRS)

GS_JAX_HANDLERS(GsJaxAllreduce, allreduce,
                .Attr<int64_t>("comm")
                    .Attr<int64_t>("op")
                    .Attr<double>("prescale")
                    .Attr<double>("postscale")
                    .Attr<int64_t>("wire"),
                int64_t, int64_t, double, double, int64_t);
GS_JAX_HANDLERS(GsJaxBroadcast, broadcast, .Attr<int64_t>("comm").Attr<int64_t>("root"), int64_t,
                int64_t);
GS_JAX_HANDLERS(GsJaxAllgather, allgather, .Attr<int64_t>("comm"), int64_t);
GS_JAX_HANDLERS(GsJaxAlltoall, alltoall, .Attr<int64_t>("comm"), int64_t);
GS_JAX_HANDLERS(
    GsJaxReduceScatter, reduce_scatter,
    .Attr<int64_t>("comm").Attr<int64_t>("op").Attr<double>("prescale").Attr<double>("postscale"),
    int64_t, int64_t, double, double);
