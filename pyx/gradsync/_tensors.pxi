# The one path by which arrays enter gradsync (included by _core.pyx).
#
#   numpy.ndarray              used as it is (the fast path: no Python work)
#   gradsync.DeviceArray       read from its fields; the call's work stream
#                              waits for the writes recorded on it (for every
#                              recorded use, when the call writes it)
#   DLPack C exchange API      types with __dlpack_c_exchange_api__ (DLPack
#                              1.3; torch.Tensor): the tensor is read by one C
#                              call, and the producer's current stream becomes
#                              the call's work stream (once per call and
#                              device, not per tensor).
#   __dlpack__ objects         host or CUDA; the capsule is parsed here. A 1.x
#                              (versioned) capsule is asked for, a legacy one
#                              accepted. For CUDA memory the producer is given
#                              the call's work stream (the legacy default
#                              stream unless a producer named another) and
#                              orders it after its own work.
#   __cuda_array_interface__   CUDA memory (v2/v3); a 'stream' entry becomes
#                              the call's work stream. The interface carries
#                              no device, so an empty array is taken to be on
#                              the calling thread's current CUDA device.
#   the buffer protocol        host memory, through numpy.asarray
#
# In-place calls write only into memory its producer lets them write: never
# into a non-writeable NumPy array, a DLPack 1.x tensor flagged READ_ONLY, a
# legacy (pre-1.0) DLPack capsule (it has no such flag; numpy.from_dlpack
# imports those read-only too; torch tensors excepted, torch has no read-only
# tensors), a read-only __cuda_array_interface__, or a JAX array (immutable:
# its buffer may back other arrays and cached constants).
# The refusal happens here, while the arguments are read, before any rank
# communicates or writes (docs/GUIDE.md section 2.1).
#
# The work stream (gs_cuda_set_stream) is where the gradient kernels run on
# CUDA memory, like the producer's own ops, and what collectives are ordered
# after; a blocking collective returns once its results are in place, an
# asynchronous one hands its Request the event to wait on. It is the stream
# the last producer named (the legacy default stream if none did), and it
# waits, by an event, for every other stream a producer of the call named or
# was told: a list may span several streams, and a call's second argument
# list (outputs, grad) follows the first (arguments(after=)). Every call
# sets it before the C call that reads it: nothing reads the one a previous
# call left behind.

import ml_dtypes
from cpython.pycapsule cimport PyCapsule_IsValid, PyCapsule_GetPointer, PyCapsule_SetName
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

bfloat16 = ml_dtypes.bfloat16

# Names and codes from the C tables (gs_dtype_name); numpy's dtype of each
# name, bfloat16 being ml_dtypes'.
DTYPE_NAMES = tuple(gs_dtype_name(<gs_dtype_t>code).decode() for code in range(GS_NUM_DTYPES))
_NP_DTYPES = [np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)
              for name in DTYPE_NAMES]  # by gs_dtype_t
_DTYPES = {dt: code for code, dt in enumerate(_NP_DTYPES)}
_DTYPE_NAMES = ", ".join(DTYPE_NAMES)

# DLPack (type code, bits) -> gs_dtype_t
_DL_DTYPES = {
    (kDLFloat, 16): GS_FLOAT16, (kDLBfloat, 16): GS_BFLOAT16, (kDLFloat, 32): GS_FLOAT32,
    (kDLFloat, 64): GS_FLOAT64, (kDLInt, 8): GS_INT8, (kDLUInt, 8): GS_UINT8,
    (kDLInt, 32): GS_INT32, (kDLInt, 64): GS_INT64,
}


cdef int dl_dtype(DLDataType t) noexcept:
    """The gs_dtype_t of a DLPack dtype, or -1."""
    if t.lanes != 1:
        return -1
    if t.code == kDLFloat:
        return GS_FLOAT16 if t.bits == 16 else GS_FLOAT32 if t.bits == 32 else \
            GS_FLOAT64 if t.bits == 64 else -1
    if t.code == kDLBfloat:
        return GS_BFLOAT16 if t.bits == 16 else -1
    if t.code == kDLInt:
        return GS_INT8 if t.bits == 8 else GS_INT32 if t.bits == 32 else \
            GS_INT64 if t.bits == 64 else -1
    if t.code == kDLUInt:
        return GS_UINT8 if t.bits == 8 else -1
    return -1


_DL_CODE_NAMES = {kDLInt: "int", kDLUInt: "uint", kDLFloat: "float", kDLBfloat: "bfloat",
                  kDLComplex: "complex", kDLBool: "bool", kDLOpaqueHandle: "opaque"}

# __cuda_array_interface__ typestr -> gs_dtype_t. bfloat16 has no typestr of
# its own ('<V2' is any 2-byte record): it is read as bfloat16 only when descr
# says so, as DeviceArray writes it: [('bfloat16', '<V2')].
_CAI_DTYPES = {
    "<f2": GS_FLOAT16, "<f4": GS_FLOAT32, "<f8": GS_FLOAT64,
    "|i1": GS_INT8, "<i1": GS_INT8, "|u1": GS_UINT8, "<u1": GS_UINT8,
    "<i4": GS_INT32, "<i8": GS_INT64,
}
_CAI_BF16_DESCR = [("bfloat16", "<V2")]

# DLPack's device codes (__dlpack_device__()[0]), for the Python layers
DLPACK_CPU, DLPACK_CUDA, DLPACK_CUDA_HOST = kDLCPU, kDLCUDA, kDLCUDAHost

cdef class TensorList  # defined at the end


cdef str label(str name, Py_ssize_t i, bint indexed):
    return f"{name}[{i}]" if indexed else name


cdef str device_words(gs_device_t d):
    if d.kind == GS_DEVICE_CUDA:
        return f"CUDA device {d.id}"
    return "pinned host" if d.kind == GS_DEVICE_CUDA_HOST else "host"


cdef int check_status(gs_status_t s, str where) except -1:
    """CHKERR for calls made while reading an argument: names the argument."""
    if s == GS_SUCCESS:
        return 0
    exc = error_for(s)
    if isinstance(exc, Error):
        raise type(exc)(f"{where}: {exc}", s)
    raise exc


cdef class _TensorRef:
    """One array's memory as gradsync sees it: what a gs_tensor_t needs, plus
    shape and dtype. DeviceArray is one; the binding makes others (internal)
    for arrays it borrows, keeping their owner alive."""
    cdef void *data
    cdef int64_t count
    cdef gs_dtype_t gsdtype
    cdef gs_device_t dev
    cdef bint readonly
    cdef str readonly_why  # why it is read-only, for the error (None: writable)
    cdef bint copied      # the producer handed over a copy (DLPack IS_COPIED)
    # the stream its producer named (CAI, C exchange API) or was told
    # (DLPack), 0 if none: a call that takes this view again orders after it
    cdef uintptr_t stream
    cdef bint named       # the producer named `stream` (it becomes the work stream)
    cdef tuple _shape
    cdef object _dtype    # numpy dtype
    cdef object owner     # keeps the memory alive (DLPack owner, the exporting object)

    @property
    def shape(self):
        """The shape, a tuple of ints."""
        return self._shape

    @property
    def dtype(self):
        """The element type as a numpy dtype (bfloat16 is ml_dtypes.bfloat16)."""
        return self._dtype

    @property
    def ndim(self):
        """Number of dimensions."""
        return len(self._shape)

    @property
    def size(self):
        """Number of elements."""
        return self.count


cdef class _DLPackOwner:
    """Holds a consumed DLPack managed tensor; its deleter runs when this goes."""
    cdef DLManagedTensorVersioned *versioned
    cdef DLManagedTensor *legacy

    def __dealloc__(self):
        if self.versioned != NULL and self.versioned.deleter != NULL:
            self.versioned.deleter(self.versioned)
        elif self.legacy != NULL and self.legacy.deleter != NULL:
            self.legacy.deleter(self.legacy)


cdef bint contiguous(int ndim, const int64_t *shape, const int64_t *strides,
                     int64_t unit) noexcept:
    """C order, with strides counted in `unit`s; size-1 dimensions may have any
    stride, and an empty array is contiguous."""
    cdef int d
    cdef int64_t expect = unit
    if strides == NULL:
        return True
    for d in range(ndim):
        if shape[d] == 0:
            return True
    for d in range(ndim - 1, -1, -1):
        if shape[d] != 1 and strides[d] != expect:
            return False
        expect *= shape[d]
    return True


cdef str dl_dtype_name(DLDataType t):
    base = _DL_CODE_NAMES.get(t.code, f"type code {t.code} ")
    return f"{base}{t.bits}" + (f"x{t.lanes}" if t.lanes != 1 else "")


cdef _TensorRef ref_from_dltensor(const DLTensor *dl, uint64_t flags, str name,
                                  Py_ssize_t i, bint indexed):
    """Checks a DLTensor (device, dtype, layout) and describes its memory."""
    cdef int64_t count = 1
    cdef int d
    cdef _TensorRef ref = _TensorRef.__new__(_TensorRef)
    kind = dl.device.device_type
    if kind == kDLCUDA:
        ref.dev.kind = GS_DEVICE_CUDA
        ref.dev.id = dl.device.device_id
    elif kind == kDLCPU or kind == kDLCUDAHost:
        ref.dev.kind = GS_DEVICE_CPU if kind == kDLCPU else GS_DEVICE_CUDA_HOST
        ref.dev.id = 0
    else:
        raise UnsupportedError(
            f"{label(name, i, indexed)} lives on DLPack device "
            f"{(kind, dl.device.device_id)}; gradsync takes host and CUDA memory",
            GS_ERR_UNSUPPORTED)
    cdef int code = dl_dtype(dl.dtype)
    if code < 0:
        raise DtypeError(f"{label(name, i, indexed)} has dtype {dl_dtype_name(dl.dtype)}, "
                         f"which gradsync does not support; use one of {_DTYPE_NAMES}",
                         GS_ERR_TYPE)
    if dl.ndim < 0 or (dl.ndim > 0 and dl.shape == NULL):
        raise ArgumentError(f"{label(name, i, indexed)}: the DLPack tensor has no valid "
                            "shape", GS_ERR_INVALID_ARGUMENT)
    shape = PyTuple_New(dl.ndim)
    for d in range(dl.ndim):
        count *= dl.shape[d]
        dim = <object>dl.shape[d]   # a Python int that the tuple owns a reference to
        Py_INCREF(dim)
        PyTuple_SET_ITEM(shape, d, dim)
    if not contiguous(dl.ndim, dl.shape, dl.strides, 1):
        where = label(name, i, indexed)
        raise ArgumentError(f"{where} is not C-contiguous; pass a contiguous copy of {where}",
                            GS_ERR_INVALID_ARGUMENT)
    ref.gsdtype = <gs_dtype_t>code
    ref._dtype = _NP_DTYPES[code]
    ref._shape = shape
    ref.count = count
    ref.data = (<char *>dl.data) + dl.byte_offset if dl.data != NULL else NULL
    if flags & DLPACK_FLAG_BITMASK_READ_ONLY:
        set_read_only(ref, "its producer flagged it read-only (DLPack READ_ONLY)")
    ref.copied = (flags & DLPACK_FLAG_BITMASK_IS_COPIED) != 0
    return ref


cdef _TensorRef from_dlpack(object obj, str name, Py_ssize_t i, bint indexed, TensorList tl):
    """Reads obj through __dlpack__: asks for a 1.x capsule (legacy if the
    producer does not take max_version) and, for CUDA memory, passes the
    call's work stream, which the producer orders after its own work. The
    capsule's tensor is released with the reference."""
    cdef _DLPackOwner holder = _DLPackOwner()
    cdef DLTensor *dl
    cdef uint64_t flags = 0
    cdef _TensorRef ref
    dev = obj.__dlpack_device__()
    kind = int(dev[0])
    if kind == kDLCUDA:
        cuda_ordinal(int(dev[1]), label(name, i, indexed))  # a CUDA build and that device
        kwargs = {"stream": tl.work_stream}
        tl.add_stream(tl.work_stream, False)  # ordered after its work: the call must follow
    elif kind == kDLCPU or kind == kDLCUDAHost:
        kwargs = {}
    else:
        raise UnsupportedError(
            f"{label(name, i, indexed)} lives on DLPack device {(kind, int(dev[1]))}; "
            "gradsync takes host and CUDA memory", GS_ERR_UNSUPPORTED)
    try:
        try:
            capsule = obj.__dlpack__(max_version=(DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION),
                                     **kwargs)
        except TypeError:  # a producer from before DLPack 1.0
            capsule = obj.__dlpack__(**kwargs)
    except Exception as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised by {label(name, i, indexed)}.__dlpack__, called by gradsync)")
        raise
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        holder.versioned = <DLManagedTensorVersioned *>PyCapsule_GetPointer(
            capsule, b"dltensor_versioned")
        PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        if holder.versioned.version.major != DLPACK_MAJOR_VERSION:
            raise UnsupportedError(
                f"{label(name, i, indexed)} came as a DLPack {holder.versioned.version.major}."
                f"{holder.versioned.version.minor} tensor; gradsync reads DLPack 1.x",
                GS_ERR_UNSUPPORTED)
        dl = &holder.versioned.dl_tensor
        flags = holder.versioned.flags
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        holder.legacy = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        PyCapsule_SetName(capsule, b"used_dltensor")
        dl = &holder.legacy.dl_tensor
    else:
        raise TypeError(f"{label(name, i, indexed)}.__dlpack__() returned "
                        f"{type(capsule).__name__}, not an unused DLPack capsule")
    ref = ref_from_dltensor(dl, flags, name, i, indexed)
    ref.owner = holder
    if kind == kDLCUDA:
        ref.stream = tl.work_stream
    if holder.legacy != NULL and producer_kind(type(obj)) != _WRITABLE_PRODUCER:
        set_read_only(ref, "it came as a legacy (pre-1.0) DLPack capsule, which cannot say "
                      "whether its memory may be written, so gradsync takes it as read-only "
                      "(as numpy.from_dlpack does)")
    return ref


_EXCHANGE_APIS = {}  # type -> its DLPackExchangeAPI* as an int (0: none usable)


cdef const DLPackExchangeAPI *exchange_api(type tp):
    """The DLPack C exchange API of a type, or NULL (looked up once per type)."""
    cdef const DLPackExchangeAPI *api = NULL
    found = _EXCHANGE_APIS.get(tp)
    if found is None:
        cap = getattr(tp, "__dlpack_c_exchange_api__", None)
        if cap is not None and PyCapsule_IsValid(cap, b"dlpack_exchange_api"):
            api = <const DLPackExchangeAPI *>PyCapsule_GetPointer(cap, b"dlpack_exchange_api")
            if api != NULL and (api.header.version.major != DLPACK_MAJOR_VERSION
                                or api.dltensor_from_py_object_no_sync == NULL
                                or api.current_work_stream == NULL):
                api = NULL
        found = _EXCHANGE_APIS[tp] = <uintptr_t>api
    return <const DLPackExchangeAPI *><uintptr_t>found


cdef _TensorRef from_exchange_api(object obj, const DLPackExchangeAPI *api, str name,
                                  Py_ssize_t i, bint indexed, TensorList tl):
    """Reads obj through its type's C exchange API (no capsule, no Python
    call); obj itself keeps the memory alive. The producer's current stream
    on that device becomes the call's work stream."""
    cdef DLTensor dl
    cdef void *stream = NULL
    cdef _TensorRef ref
    try:
        api.dltensor_from_py_object_no_sync(<void *>obj, &dl)
    except Exception as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised reading {label(name, i, indexed)} through DLPack)")
        raise
    ref = ref_from_dltensor(&dl, 0, name, i, indexed)
    ref.owner = obj
    if ref.dev.kind == GS_DEVICE_CUDA and (tl.ordered_api != api
                                           or tl.ordered_device != ref.dev.id):
        api.current_work_stream(kDLCUDA, ref.dev.id, &stream)
        tl.add_stream(<uintptr_t>stream if stream != NULL else 1, True)  # NULL: legacy default
        tl.ordered_api = api
        tl.ordered_device = ref.dev.id
    if ref.dev.kind == GS_DEVICE_CUDA:
        ref.stream = tl.work_stream
        ref.named = True
    return ref


cdef _TensorRef from_cuda_array_interface(object obj, str name, Py_ssize_t i, bint indexed,
                                          TensorList tl):
    """Reads obj's __cuda_array_interface__ (versions 2 and 3)."""
    cdef int dev_id = 0
    cdef gs_device_t where_is
    cdef int64_t count = 1, itemsize
    cdef int d, ndim
    cdef int64_t[::1] shape_c, strides_c
    cdef _TensorRef ref
    cai = obj.__cuda_array_interface__
    where = label(name, i, indexed)
    try:
        typestr = cai["typestr"]
        shape = tuple([int(s) for s in cai["shape"]])
        ptr, ro = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ArgumentError(f"{where} has an invalid __cuda_array_interface__ ({exc!r}): it "
                            "needs 'typestr', 'shape' and 'data'",
                            GS_ERR_INVALID_ARGUMENT) from None
    code = _CAI_DTYPES.get(typestr)
    if code is None and typestr in ("<V2", "|V2") and cai.get("descr") == _CAI_BF16_DESCR:
        code = GS_BFLOAT16
    if code is None:
        hint = (" (a 2-byte record: gradsync reads it as bfloat16 only with descr "
                f"{_CAI_BF16_DESCR})" if typestr in ("<V2", "|V2") else "")
        raise DtypeError(f"{where} has typestr {typestr!r}{hint}, which gradsync does not "
                         f"support; use one of {_DTYPE_NAMES}", GS_ERR_TYPE)
    if cai.get("mask") is not None:
        raise ArgumentError(f"{where} is a masked CUDA array; gradsync takes plain arrays",
                            GS_ERR_INVALID_ARGUMENT)
    for s in shape:
        count *= s
    strides = cai.get("strides")
    if strides is not None:
        ndim = len(shape)
        if len(strides) != ndim:
            raise ArgumentError(f"{where}: __cuda_array_interface__ has {len(strides)} strides "
                                f"for {ndim} dimensions", GS_ERR_INVALID_ARGUMENT)
        itemsize = gs_dtype_size(<gs_dtype_t><int>code)
        shape_c = np.array(shape + (0,), dtype=np.int64)
        strides_c = np.array(tuple(strides) + (0,), dtype=np.int64)
        if not contiguous(ndim, &shape_c[0], &strides_c[0], itemsize):
            raise ArgumentError(f"{where} is not C-contiguous; pass a contiguous copy of "
                                f"{where}", GS_ERR_INVALID_ARGUMENT)
    if count > 0 and not ptr:
        raise ArgumentError(f"{where}: __cuda_array_interface__ data pointer is NULL",
                            GS_ERR_INVALID_ARGUMENT)
    stream = cai.get("stream")
    if stream is not None and (not isinstance(stream, int) or stream <= 0):
        raise ArgumentError(f"{where}: __cuda_array_interface__ stream {stream!r} is not a "
                            "stream (1: legacy default, 2: per-thread default, else a "
                            "cudaStream_t; 0 is disallowed)", GS_ERR_INVALID_ARGUMENT)
    # the pointer's own device: the array may live on a GPU other than the current one
    if count > 0:
        check_status(gs_pointer_device(<void *><uintptr_t>ptr, &where_is), where)
        if where_is.kind != GS_DEVICE_CUDA:
            raise ArgumentError(f"{where}: its __cuda_array_interface__ pointer is not CUDA "
                                "device memory", GS_ERR_INVALID_ARGUMENT)
        dev_id = where_is.id
    else:
        check_status(gs_cuda_get_device(&dev_id), where)
    if stream is not None:
        tl.add_stream(<uintptr_t>stream, True)
    ref = _TensorRef.__new__(_TensorRef)
    if stream is not None:
        ref.stream = <uintptr_t>stream
        ref.named = True
    ref.owner = obj
    ref.data = <void *><uintptr_t>ptr
    ref.count = count
    ref.gsdtype = <gs_dtype_t><int>code
    ref.dev.kind = GS_DEVICE_CUDA
    ref.dev.id = dev_id
    if ro:
        set_read_only(ref, "its __cuda_array_interface__ marks the data read-only")
    ref._shape = shape
    ref._dtype = _NP_DTYPES[code]
    return ref


cdef int set_read_only(_TensorRef ref, str why) except -1:
    ref.readonly = True
    if ref.readonly_why is None:
        ref.readonly_why = why
    return 0


# What gradsync knows of a producer type whatever its DLPack export says.
cdef enum:
    _UNKNOWN_PRODUCER = 0
    _WRITABLE_PRODUCER = 1   # torch: no tensor is read-only (torch < 2.9 exports legacy capsules)
    # JAX: every array is (0.10 exports legacy capsules, a later release may
    # export 1.x ones without the READ_ONLY flag)
    _IMMUTABLE_PRODUCER = 2
_PRODUCER_KINDS = {}  # type -> one of the above, looked up once per type
_JAX_WHY = ("it is a JAX array; JAX arrays are immutable, and writing into one can change "
            "other arrays and cached constants that share its buffer")


cdef int producer_kind(type tp):
    kind = _PRODUCER_KINDS.get(tp)
    if kind is None:
        kind = _UNKNOWN_PRODUCER
        for cls in tp.__mro__:
            top = (getattr(cls, "__module__", None) or "").split(".")[0]
            if top in ("jax", "jaxlib"):
                kind = _IMMUTABLE_PRODUCER
                break
            if top == "torch" and cls.__name__ == "Tensor":
                kind = _WRITABLE_PRODUCER
                break
        _PRODUCER_KINDS[tp] = kind
    return kind


cdef object as_array(object obj, str name, Py_ssize_t i, bint indexed, TensorList tl):
    """An ndarray (host memory) or a _TensorRef viewing obj's memory, or a
    clear error. Never copies."""
    if isinstance(obj, (np.ndarray, _TensorRef)):
        return obj
    cdef _TensorRef ref
    cdef const DLPackExchangeAPI *api = exchange_api(type(obj))
    if api != NULL:
        ref = from_exchange_api(obj, api, name, i, indexed, tl)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        ref = from_dlpack(obj, name, i, indexed, tl)
    elif hasattr(obj, "__cuda_array_interface__"):
        ref = from_cuda_array_interface(obj, name, i, indexed, tl)
    else:
        return from_buffer(obj, name, i, indexed)
    if producer_kind(type(obj)) == _IMMUTABLE_PRODUCER:
        ref.readonly = True
        ref.readonly_why = _JAX_WHY
    return ref


cdef object from_buffer(object obj, str name, Py_ssize_t i, bint indexed):
    """The buffer protocol, through numpy.asarray (read-only buffers stay so)."""
    try:
        memoryview(obj)
    except TypeError:
        raise TypeError(f"{label(name, i, indexed)} must be a numpy.ndarray, a "
                        "gradsync.DeviceArray or an object with __dlpack__, "
                        "__cuda_array_interface__ or the buffer protocol, not "
                        f"{type(obj).__name__}") from None
    return np.asarray(obj)


# What to do instead, by the in-place call that met a read-only array.
_INSTEAD = {
    "comm.allreduce_": "the out-of-place comm.allreduce(...) returns new arrays "
                       "(gradsync.jax.allreduce for JAX arrays)",
    "comm.allreduce_async_": "the out-of-place comm.allreduce(...) returns new arrays "
                             "(gradsync.jax.allreduce for JAX arrays)",
    "comm.broadcast_": "the out-of-place comm.broadcast(...) returns new arrays "
                       "(gradsync.jax.broadcast for JAX arrays)",
    "comm.broadcast_async_": "the out-of-place comm.broadcast(...) returns new arrays "
                             "(gradsync.jax.broadcast for JAX arrays)",
    "gs.zero_": "make a new zeroed array instead (numpy.zeros_like; jax.numpy.zeros_like "
                "for JAX arrays)",
    "gs.scale_": "gradsync.jax.scale returns a new array for JAX arrays; otherwise pass a "
                 "writable copy",
    "gs.accumulate_": "gradsync.jax.accumulate returns a new array for JAX arrays; otherwise "
                      "pass a writable copy",
}


cdef str read_only_message(str where, str why, str call):
    instead = _INSTEAD.get(call, "it has no out-of-place form: pass a writable copy")
    return (f"{where} is read-only: {why}. {call or 'This call'} writes into its arguments "
            f"in place; {instead}. Nothing was written")


cdef int fill_tensor(gs_tensor_t *t, cnp.ndarray arr, str name, Py_ssize_t i,
                     bint indexed, bint writable, str call=None) except -1:
    # Labels are formatted only on failure: this runs once per tensor per call.
    dt = _DTYPES.get(arr.dtype)
    if dt is None:
        raise DtypeError(f"{label(name, i, indexed)} has dtype {arr.dtype}, which gradsync "
                         f"does not support; use one of {_DTYPE_NAMES}", GS_ERR_TYPE)
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        where = label(name, i, indexed)
        raise ArgumentError(f"{where} is not C-contiguous; pass numpy.ascontiguousarray({where})",
                            GS_ERR_INVALID_ARGUMENT)
    if writable and not cnp.PyArray_ISWRITEABLE(arr):
        raise ArgumentError(read_only_message(label(name, i, indexed), "the NumPy array is "
                                              "not writeable", call), GS_ERR_INVALID_ARGUMENT)
    t.data = cnp.PyArray_DATA(arr)
    t.count = cnp.PyArray_SIZE(arr)
    t.dtype = <gs_dtype_t><int>dt
    t.device.kind = GS_DEVICE_CPU
    t.device.id = 0
    return 0


cdef int fill_ref(gs_tensor_t *t, _TensorRef ref, str name, Py_ssize_t i,
                  bint indexed, bint writable, str call=None) except -1:
    if writable and ref.readonly:
        raise ArgumentError(read_only_message(label(name, i, indexed), ref.readonly_why
                                              or "its producer marked it read-only", call),
                            GS_ERR_INVALID_ARGUMENT)
    if writable and ref.copied:
        raise ArgumentError(f"{label(name, i, indexed)} was exported as a copy (DLPack "
                            "IS_COPIED), so what this call writes into it would be lost",
                            GS_ERR_INVALID_ARGUMENT)
    t.data = ref.data
    t.count = ref.count
    t.dtype = ref.gsdtype
    t.device = ref.dev
    return 0


cdef class TensorList:
    """A C array of gs_tensor_t describing Python arrays, which it keeps alive."""
    cdef gs_tensor_t *t
    cdef Py_ssize_t n
    cdef list arrays  # per tensor: the ndarray or _TensorRef its gs_tensor_t views
    cdef str name     # the argument's name, for errors
    cdef bint indexed
    # the producer (C exchange API) and device whose current stream was last
    # read in this call
    cdef const DLPackExchangeAPI *ordered_api
    cdef int ordered_device
    # the call's work stream (gs_cuda_set_stream): 1, the legacy default
    # stream, unless a producer named its own
    cdef uintptr_t work_stream
    cdef list streams     # every stream a producer named or was told, once each (or None)
    cdef bint writable    # the call writes these arrays
    cdef gs_mem_t *mems   # the records of the DeviceArrays among them
    cdef Py_ssize_t nmems
    cdef TensorList after  # the call's earlier argument list, or None

    def __cinit__(self):
        self.t = NULL
        self.n = 0
        self.ordered_api = NULL
        self.ordered_device = -1
        self.work_stream = 1
        self.mems = NULL
        self.nmems = 0

    def __dealloc__(self):
        PyMem_Free(self.t)
        PyMem_Free(self.mems)

    cdef int add_stream(self, uintptr_t stream, bint named) except -1:
        """A stream the call must follow; named: the producer's, which
        becomes the work stream."""
        if self.streams is None:
            self.streams = [stream]
        elif stream not in self.streams:
            self.streams.append(stream)
        if named:
            self.work_stream = stream
        return 0

    cdef int follows(self, TensorList earlier) except -1:
        """This list is the same call's next argument list: it starts from
        the streams the earlier one met."""
        if earlier is not None:
            self.after = earlier
            self.work_stream = earlier.work_stream
            self.streams = list(earlier.streams) if earlier.streams else None
            self.ordered_api = earlier.ordered_api
            self.ordered_device = earlier.ordered_device
        return 0

    cdef int order(self) except -1:
        """Makes the work stream follow every other stream of the call and
        the DeviceArrays' recorded uses (their last write; every use when the
        call writes them), and sets it for the C call that follows."""
        cdef uintptr_t w = self.work_stream
        cdef int dev = self.t[0].device.id
        cdef TensorList before = self.after
        for s in self.streams or ():
            if s != w:
                CHKERR(gs_cuda_stream_order(dev, w, s))
        if self.nmems:
            CHKERR(gs_mem_order(self.mems, self.nmems, w, self.writable))
        if before is not None and before.work_stream != w and before.nmems:
            CHKERR(gs_mem_order(before.mems, before.nmems, w, before.writable))
        gs_cuda_set_stream(w)  # this thread's, for the call that follows
        return 0

    cdef int used(self, uintptr_t stream) except -1:
        """Work the call queued on `stream` (without waiting for it) uses
        the DeviceArrays: recorded, for their consumers and their free."""
        if self.nmems:
            CHKERR(gs_mem_use(self.mems, self.nmems, stream, self.writable))
        return 0

    cdef str label(self, Py_ssize_t i):
        """How errors name tensor i: "tensors[i]", or "tensor" alone."""
        return label(self.name, i, self.indexed)

    cdef int load(self, list objs, str name, bint indexed, bint writable,
                  str call=None) except -1:
        """Reads objs; writable: the call writes into them (``call`` names it
        in the error for a read-only one)."""
        cdef Py_ssize_t i, n = len(objs)
        cdef bint cuda
        self.t = <gs_tensor_t *>PyMem_Malloc(max(n, 1) * sizeof(gs_tensor_t))
        if self.t == NULL:
            raise MemoryError()
        self.n = n
        self.arrays = objs
        self.name = name
        self.indexed = indexed
        self.writable = writable
        for i in range(n):
            obj = objs[i]
            if type(obj) is not np.ndarray:
                if self.arrays is objs:
                    self.arrays = list(objs)
                obj = as_array(obj, name, i, indexed, self)
                self.arrays[i] = obj
                if isinstance(obj, _TensorRef):
                    fill_ref(&self.t[i], <_TensorRef>obj, name, i, indexed, writable, call)
                    self.met(<_TensorRef>obj, n)
                    continue
            fill_tensor(&self.t[i], obj, name, i, indexed, writable, call)
        # one call, one memory: host (plain or pinned) or one CUDA device
        for i in range(1, n):
            cuda = self.t[i].device.kind == GS_DEVICE_CUDA
            if cuda != (self.t[0].device.kind == GS_DEVICE_CUDA) or (
                    cuda and self.t[i].device.id != self.t[0].device.id):
                raise ArgumentError(
                    f"{label(name, i, indexed)} is in {device_words(self.t[i].device)} memory "
                    f"but {label(name, 0, indexed)} is in {device_words(self.t[0].device)} "
                    "memory; one call takes tensors on one device", GS_ERR_INVALID_ARGUMENT)
        if n > 0 and self.t[0].device.kind == GS_DEVICE_CUDA:
            self.order()
        return 0

    cdef int met(self, _TensorRef ref, Py_ssize_t n) except -1:
        """A view read earlier (its stream) or a DeviceArray (its record)."""
        if ref.dev.kind != GS_DEVICE_CUDA:
            return 0
        if isinstance(ref, DeviceArray):
            if self.mems == NULL:
                self.mems = <gs_mem_t *>PyMem_Malloc(max(n, 1) * sizeof(gs_mem_t))
                if self.mems == NULL:
                    raise MemoryError()
            self.mems[self.nmems] = (<DeviceArray>ref).mem
            self.nmems += 1
        elif ref.stream != 0:  # (again, for one just read: the same stream)
            self.add_stream(ref.stream, ref.named)
        return 0


# What one array, not a list, is called in errors, by the argument's name.
_SINGULAR = {"tensors": "tensor"}


cdef TensorList arguments(object tensors, str name, bint writable, str call=None,
                          str one=None, TensorList after=None):
    """The binding's reading of an array argument: one array or a list/tuple
    of them (named ``name[i]`` in errors; one array ``one``, by default
    ``_SINGULAR[name]``); writable: the call writes into them (``call`` names
    it in the error for a read-only one); after: the same call's earlier
    argument list, whose streams this one's work stream follows too."""
    cdef TensorList tl = TensorList()
    tl.follows(after)
    if type(tensors) is list:
        tl.load(<list>tensors, name, True, writable, call)
    elif type(tensors) is tuple:
        tl.load(list(tensors), name, True, writable, call)
    else:
        tl.load([tensors], one or _SINGULAR.get(name, name), False, writable, call)
    return tl
