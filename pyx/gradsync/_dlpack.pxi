# Producers other than NumPy read into a _TensorRef (included by _core.pyx
# after _dtypes.pxi): DLPack capsules (1.x and legacy), the DLPack C
# exchange API, __cuda_array_interface__; which of them may be written
# (set_read_only). _tensors.pxi says which producer is asked when.

cdef class TensorList  # defined in _tensors.pxi


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
