# gradsync.DeviceArray (included by _core.pyx): memory from gs_malloc that
# gradsync's calls take directly and other libraries take zero-copy through
# DLPack and __cuda_array_interface__.

import operator

from libc.stdlib cimport malloc, free

cdef extern from "Python.h":
    ctypedef void (*capsule_destructor "PyCapsule_Destructor")(PyObject *)
    object capsule_new "PyCapsule_New"(void *ptr, const char *name,
                                       capsule_destructor destructor)

cdef extern from "Python.h" nogil:
    # borrowed (PyObject *) forms: a capsule destructor runs on a dead object
    int capsule_is_valid "PyCapsule_IsValid"(PyObject *capsule, const char *name)
    void *capsule_pointer "PyCapsule_GetPointer"(PyObject *capsule, const char *name)
    int Py_IsInitialized()

# gs_dtype_t -> DLPack (type code, bits)
_GS_TO_DL = {code: key for key, code in _DL_DTYPES.items()}


cdef void release_export(void *owner) noexcept nogil:
    """Drops the reference a DLPack export holds on its DeviceArray. Consumers
    may call deleters from any thread, with or without the GIL."""
    if owner == NULL or not Py_IsInitialized():
        return  # at interpreter exit: leave it rather than touch a dying runtime
    with gil:
        Py_DECREF(<object>owner)


cdef void delete_versioned(DLManagedTensorVersioned *m) noexcept nogil:
    cdef void *owner
    if m != NULL:
        owner = m.manager_ctx
        free(m)
        release_export(owner)


cdef void delete_legacy(DLManagedTensor *m) noexcept nogil:
    cdef void *owner
    if m != NULL:
        owner = m.manager_ctx
        free(m)
        release_export(owner)


cdef void capsule_free(PyObject *capsule) noexcept:
    """PyCapsule destructor: a capsule nobody consumed releases its tensor (a
    consumer renames it to used_*, and then owns the deleter call)."""
    cdef DLManagedTensorVersioned *mv
    cdef DLManagedTensor *m
    if capsule_is_valid(capsule, b"dltensor_versioned"):
        mv = <DLManagedTensorVersioned *>capsule_pointer(capsule, b"dltensor_versioned")
        mv.deleter(mv)
    elif capsule_is_valid(capsule, b"dltensor"):
        m = <DLManagedTensor *>capsule_pointer(capsule, b"dltensor")
        m.deleter(m)


cdef class DeviceArray(_TensorRef):
    """A C-contiguous array in memory that gradsync allocated (gs_malloc).

    ``DeviceArray(shape, dtype, device=None)``: ``device`` None (or 'cuda') is
    the current CUDA device, an int (or 'cuda:N') that CUDA device, 'cpu' host
    memory and 'cuda_host' pinned host memory. dtype is one of gradsync's
    (bfloat16 is ml_dtypes.bfloat16). The contents start uninitialised.

    Every gradsync call takes it directly. Other libraries take it zero-copy:
    ``torch.from_dlpack(a)``, ``cupy.from_dlpack(a)`` (DLPack 1.x or legacy
    capsules), or ``__cuda_array_interface__`` (CUDA memory only).

    CUDA memory is stream-ordered. The array is allocated and freed on
    gradsync's memory stream of its device, and it records every stream that
    gradsync's calls and exports use it on, when they do: its free waits for
    them all (never for a stream that may be gone since), and a later call
    on another stream waits for its last write (for every use, when the call
    writes it). Work that may still be pending: the copy into it of
    to_device/copy_from, gradient kernels on a caller's stream, a collective
    still writing it. ``__dlpack__(stream=s)`` makes the consumer's stream
    ``s`` wait for all of it (None: the host waits; -1: nothing), and the
    interface's 'stream' names a stream that follows it all (None when
    nothing is pending). Work a consumer queues after the export is the
    consumer's to finish before it drops the array, as with any DLPack
    producer.
    """
    cdef int64_t *shape_c    # shape and C strides (in elements) for DLPack exports
    cdef int64_t *strides_c
    cdef gs_mem_t mem        # the memory and the record of its streams
    cdef object __weakref__
    cdef public object pending  # a weak reference to the Request writing it, or None

    def __cinit__(self, shape, dtype, device=None):
        cdef Py_ssize_t d, ndim
        cdef int64_t stride = 1
        cdef size_t nbytes
        dims = (operator.index(shape),) if not isinstance(shape, (tuple, list)) \
            else tuple([operator.index(s) for s in shape])
        dt = np.dtype(dtype)
        code = _DTYPES.get(dt)
        if code is None:
            raise DtypeError(f"DeviceArray: dtype {dt} is not one gradsync supports; use one "
                             f"of {_DTYPE_NAMES}", GS_ERR_TYPE)
        count = 1
        for s in dims:
            if s < 0:
                raise ArgumentError(f"DeviceArray: negative dimension in shape {dims}",
                                    GS_ERR_INVALID_ARGUMENT)
            count *= s
        if count * dt.itemsize >= 2**62:
            raise ArgumentError(f"DeviceArray: shape {dims} is too large",
                                GS_ERR_INVALID_ARGUMENT)
        self.dev = parse_device(device, "DeviceArray")
        ndim = len(dims)
        self.shape_c = <int64_t *>PyMem_Malloc(max(ndim, 1) * sizeof(int64_t))
        self.strides_c = <int64_t *>PyMem_Malloc(max(ndim, 1) * sizeof(int64_t))
        if self.shape_c == NULL or self.strides_c == NULL:
            raise MemoryError()
        for d in range(ndim - 1, -1, -1):
            self.shape_c[d] = dims[d]
            self.strides_c[d] = stride
            stride *= max(<int64_t>dims[d], 1)
        self._shape = dims
        self._dtype = dt
        self.gsdtype = <gs_dtype_t><int>code
        self.count = count
        nbytes = <size_t>(count * dt.itemsize)
        with nogil:
            CHKERR(gs_mem_alloc(self.dev, nbytes, &self.mem))
        self.data = gs_mem_ptr(self.mem)

    def __dealloc__(self):
        # after every recorded use, on gradsync's memory stream; cannot
        # report from here, frees what it can
        gs_mem_free(&self.mem)
        PyMem_Free(self.shape_c)
        PyMem_Free(self.strides_c)

    # ---- what it is -------------------------------------------------------
    @property
    def nbytes(self):
        """Bytes of memory the elements take."""
        return self.count * self._dtype.itemsize

    @property
    def device(self):
        """Where the memory is, as DLPack numbers it: (1, 0) host, (2, N) CUDA
        device N, (3, 0) pinned host memory."""
        return (<int>self.dev.kind, <int>self.dev.id)

    @property
    def ptr(self):
        """The address of the first element, an int."""
        return <uintptr_t>self.data

    def __repr__(self):
        where = {GS_DEVICE_CPU: "'cpu'", GS_DEVICE_CUDA_HOST: "'cuda_host'"}.get(
            self.dev.kind, f"'cuda:{self.dev.id}'")
        return f"DeviceArray(shape={self._shape}, dtype={self._dtype}, device={where})"

    # ---- copies -----------------------------------------------------------
    @staticmethod
    def from_numpy(arr, device=None):
        """A new DeviceArray on ``device`` (as in the constructor) holding a
        copy of ``arr``: a NumPy array or anything gradsync's calls take
        (DLPack, __cuda_array_interface__, another DeviceArray)."""
        if isinstance(arr, np.ndarray):
            arr = np.ascontiguousarray(arr)
        elif not (isinstance(arr, _TensorRef) or hasattr(arr, "__dlpack__")
                  or hasattr(arr, "__cuda_array_interface__")):
            arr = np.ascontiguousarray(np.asarray(arr))
        cdef TensorList tl = TensorList()
        tl.load([arr], "arr", False, False)
        src = tl.arrays[0]
        out = DeviceArray(src.shape, src.dtype, device)
        copy_memory(out, tl)
        return out

    def copy_from(self, src):
        """Copies ``src`` into this array and returns it. src is anything
        gradsync's calls take (a NumPy array, DLPack or CUDA array interface
        object, a DeviceArray) with this array's shape and dtype; other values
        (lists, scalars) go through numpy.asarray."""
        if not (isinstance(src, (np.ndarray, _TensorRef)) or hasattr(src, "__dlpack__")
                or hasattr(src, "__cuda_array_interface__")):
            src = np.asarray(src, dtype=self._dtype)
        cdef TensorList tl = TensorList()
        tl.load([src], "src", False, False)
        a = tl.arrays[0]
        if a.dtype != self._dtype or tuple(a.shape) != self._shape:
            raise ArgumentError(f"copy_from: src has shape {tuple(a.shape)} and dtype "
                                f"{a.dtype}, this array {self._shape} and {self._dtype}",
                                GS_ERR_INVALID_ARGUMENT)
        copy_memory(self, tl)
        return self

    def numpy(self):
        """A new numpy.ndarray holding a copy of the values (also for host
        memory: the array returned never aliases this one), after any
        asynchronous collective still writing this array."""
        self.order_consumer(None)
        out = np.empty(self._shape, dtype=self._dtype)
        cdef void *dst = cnp.PyArray_DATA(<cnp.ndarray>out)
        cdef gs_device_t host
        cdef size_t nbytes = <size_t>self.count * gs_dtype_size(self.gsdtype)
        host.kind = GS_DEVICE_CPU
        host.id = 0
        if self.dev.kind == GS_DEVICE_CUDA:
            # on the legacy default stream after the writes recorded on this
            # array, not after the work stream an earlier call left on this
            # thread (a caller's stream, perhaps gone since)
            CHKERR(gs_mem_order(&self.mem, 1, LEGACY_STREAM, 0))
            CHKERR(gs_cuda_set_stream(LEGACY_STREAM))
        with nogil:
            CHKERR(gs_memcpy(dst, host, self.data, self.dev, nbytes))
        return out

    # ---- DLPack producer --------------------------------------------------
    def __dlpack_device__(self):
        """(device type, device id) as DLPack numbers them."""
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule viewing this array: a 1.x "dltensor_versioned"
        capsule when the consumer's max_version is (1, x) or later, else a
        legacy "dltensor" one. The capsule keeps the array alive until the
        consumer calls the deleter (or, never consumed, until it is freed).

        stream: the stream the consumer will use (CUDA: 1 legacy default, 2
        per-thread default, a cudaStream_t, -1 none, None). That stream is
        made to wait for the work still pending on this array (None: the
        host waits; -1: nothing is waited for): an asynchronous collective
        writing it, and every use recorded on it (the consumer may write).
        dl_device: export to that device; CUDA and host memory are copied
        between (refused with copy=False), pinned memory is host memory.
        copy: True always exports a copy, False never does."""
        cdef DeviceArray src = self
        cdef gs_device_t target = self.dev
        cdef uint64_t flags = 0
        cdef bint versioned = max_version is not None and int(max_version[0]) >= 1
        self.check_stream(stream)
        if dl_device is not None:
            kind, ordinal = int(dl_device[0]), int(dl_device[1])
            if kind == kDLCPU or kind == kDLCUDAHost:
                target.kind = GS_DEVICE_CPU if kind == kDLCPU else GS_DEVICE_CUDA_HOST
                target.id = 0
            elif kind == kDLCUDA:
                target.kind = GS_DEVICE_CUDA
                target.id = ordinal
            else:
                raise BufferError(f"DeviceArray cannot be exported to DLPack device "
                                  f"{tuple(dl_device)}; it exports to host (1), CUDA (2) "
                                  "and pinned host (3) memory")
        # pinned host memory is host memory: it exports as CPU without a copy
        same = (target.kind == self.dev.kind and target.id == self.dev.id) or (
            self.dev.kind == GS_DEVICE_CUDA_HOST and target.kind == GS_DEVICE_CPU)
        if copy or not same:
            if copy is False:
                raise BufferError(f"DeviceArray on {self.device} cannot be exported to "
                                  f"{tuple(dl_device)} without a copy, and copy=False")
            r = self.in_flight()
            if r is not None:  # the copy reads what the collective writes
                r.synchronize()
            src = DeviceArray(self._shape, self._dtype, (<int>target.kind, target.id))
            src.copy_from(self)
            flags |= DLPACK_FLAG_BITMASK_IS_COPIED
        src.order_consumer(stream)  # (a copy: the copy into it)
        return src.export(versioned, target, flags)

    cdef int call_on(self, uintptr_t stream) except -1:
        """A call that writes this array is about to run with `stream` as
        its work stream: the stream follows every recorded use, and becomes
        the thread's work stream."""
        CHKERR(gs_mem_order(&self.mem, 1, stream, 1))
        gs_cuda_set_stream(stream)
        return 0

    cdef object in_flight(self):
        """The Request still writing this array, or None."""
        r = self.pending() if self.pending is not None else None
        if r is None or r.test():
            self.pending = None
            return None
        return r

    cdef int order_consumer(self, stream) except -1:
        """The consumer's stream (None: the host) waits for the collective
        writing this array, if any, and every recorded use; an export on a
        stream is recorded as a use there."""
        cdef gs_mem_t mem = self.mem
        cdef uintptr_t on
        r = self.in_flight()
        if r is not None and stream != -1:
            if stream is None or self.dev.kind != GS_DEVICE_CUDA:
                r.synchronize()
            else:
                r.wait(stream)
        if self.dev.kind != GS_DEVICE_CUDA or stream == -1:
            return 0
        if stream is None:
            with nogil:
                CHKERR(gs_mem_order(&mem, 1, 0, 1))
            return 0
        on = <uintptr_t>stream
        CHKERR(gs_mem_order(&mem, 1, on, 1))
        CHKERR(gs_mem_use(&mem, 1, on, 1))
        return 0

    cdef int check_stream(self, stream) except -1:
        if stream is None:
            return 0
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise TypeError(f"__dlpack__: stream must be an int or None, not {stream!r}")
        if self.dev.kind == GS_DEVICE_CPU and stream != -1:
            raise ValueError(f"__dlpack__: stream must be None for host memory, got {stream}")
        if stream == 0 or stream < -1:
            raise ValueError(f"__dlpack__: stream {stream} is not a CUDA stream (1: legacy "
                             "default, 2: per-thread default, else a cudaStream_t, -1: none; "
                             "0 is ambiguous and disallowed)")
        return 0

    cdef object export(self, bint versioned, gs_device_t device, uint64_t flags):
        cdef DLManagedTensorVersioned *mv = NULL
        cdef DLManagedTensor *m = NULL
        cdef DLTensor *t
        code, bits = _GS_TO_DL[self.gsdtype]
        if versioned:
            mv = <DLManagedTensorVersioned *>malloc(sizeof(DLManagedTensorVersioned))
            if mv == NULL:
                raise MemoryError()
            mv.version.major = DLPACK_MAJOR_VERSION
            mv.version.minor = DLPACK_MINOR_VERSION
            mv.manager_ctx = <void *>self
            mv.deleter = delete_versioned
            mv.flags = flags
            t = &mv.dl_tensor
        else:
            m = <DLManagedTensor *>malloc(sizeof(DLManagedTensor))
            if m == NULL:
                raise MemoryError()
            m.manager_ctx = <void *>self
            m.deleter = delete_legacy
            t = &m.dl_tensor
        t.data = self.data
        t.device.device_type = <int32_t>device.kind  # gs device kinds are DLPack's
        t.device.device_id = device.id
        t.ndim = <int32_t>len(self._shape)
        t.dtype.code = code
        t.dtype.bits = bits
        t.dtype.lanes = 1
        t.shape = self.shape_c
        t.strides = self.strides_c
        t.byte_offset = 0
        Py_INCREF(self)  # released by the deleter
        try:
            if versioned:
                return capsule_new(mv, b"dltensor_versioned", capsule_free)
            return capsule_new(m, b"dltensor", capsule_free)
        except BaseException:
            free(mv)
            free(m)
            Py_DECREF(self)
            raise

    # ---- CUDA array interface ---------------------------------------------
    cdef object pending_stream(self):
        """The stream an asynchronous collective on this array runs on, while
        it does (consumers make theirs wait for it); else gradsync's memory
        stream made to follow every use still pending; else None."""
        cdef uintptr_t s = 0
        r = self.in_flight()
        if r is not None:
            return r.stream()
        CHKERR(gs_mem_stream(self.mem, &s))
        return s if s != 0 else None

    @property
    def __cuda_array_interface__(self):
        """Version 3 of the CUDA array interface (Numba, CuPy, PyTorch).
        CUDA memory only: for host memory this attribute does not exist, so
        consumers that probe for it never mistake host memory for device
        memory. 'stream' (an int, a cudaStream_t) is one the consumer must
        synchronize with: the stream of an asynchronous collective still
        writing the array, or gradsync's memory stream made to follow the
        array's pending work (a copy into it, kernels on a caller's stream);
        None when nothing is pending. bfloat16 is typestr '<V2' with descr
        [('bfloat16', '<V2')]."""
        if self.dev.kind != GS_DEVICE_CUDA:
            raise AttributeError("__cuda_array_interface__: this DeviceArray holds host memory "
                                 f"(device {self.device}); use __dlpack__ or numpy()")
        typestr = self._dtype.str
        return {
            "shape": self._shape,
            "typestr": typestr,
            "descr": list(_CAI_BF16_DESCR) if self.gsdtype == GS_BFLOAT16 else [("", typestr)],
            "data": (<uintptr_t>self.data, False),
            "strides": None,
            "stream": self.pending_stream(),
            "version": 3,
        }


def to_device(arr, device=None):
    """DeviceArray.from_numpy: a copy of ``arr`` on ``device`` (None: the
    current CUDA device; 'cpu' host memory; see DeviceArray)."""
    return DeviceArray.from_numpy(arr, device)
