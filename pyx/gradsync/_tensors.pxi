# The one path by which arrays enter gradsync (included by _core.pyx after
# _dtypes.pxi, the dtype tables, and _dlpack.pxi, the readers of DLPack and
# CUDA-array-interface producers).
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
