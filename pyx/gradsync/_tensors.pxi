# The one path by which arrays enter gradsync (included by _core.pyx):
# NumPy arrays directly, anything else through DLPack or the buffer protocol.

import ml_dtypes

bfloat16 = ml_dtypes.bfloat16

_DTYPES = {
    np.dtype(np.float16): GS_FLOAT16,
    np.dtype(bfloat16): GS_BFLOAT16,
    np.dtype(np.float32): GS_FLOAT32,
    np.dtype(np.float64): GS_FLOAT64,
    np.dtype(np.int8): GS_INT8,
    np.dtype(np.uint8): GS_UINT8,
    np.dtype(np.int32): GS_INT32,
    np.dtype(np.int64): GS_INT64,
}
_DTYPE_NAMES = ", ".join(["float16", "bfloat16", "float32", "float64",
                          "int8", "uint8", "int32", "int64"])
_DLPACK_CPU = 1
_DLPACK_CUDA_HOST = 3


cdef object as_ndarray(object obj, str name):
    """A host ndarray viewing obj's memory (no copy), or a clear error."""
    if isinstance(obj, np.ndarray):
        return obj
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        kind = dev()[0]
        if kind not in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            raise UnsupportedError(
                f"{name} lives on device {tuple(dev())} (CUDA or another accelerator); "
                "this build of gradsync handles host memory only (GPU support needs a "
                "build with nvcc and CUDA)", GS_ERR_UNSUPPORTED)
        return np.from_dlpack(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        raise UnsupportedError(
            f"{name} is a CUDA array (__cuda_array_interface__); this build of gradsync "
            "handles host memory only", GS_ERR_UNSUPPORTED)
    try:
        memoryview(obj)
    except TypeError:
        raise TypeError(f"{name} must be a numpy.ndarray or an object with __dlpack__ "
                        f"or the buffer protocol, not {type(obj).__name__}") from None
    return np.asarray(obj)


cdef str label(str name, Py_ssize_t i, bint indexed):
    return f"{name}[{i}]" if indexed else name


cdef int fill_tensor(gs_tensor_t *t, cnp.ndarray arr, str name, Py_ssize_t i,
                     bint indexed, bint writable) except -1:
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
        raise ArgumentError(f"{label(name, i, indexed)} is read-only, but this call writes "
                            "into it", GS_ERR_INVALID_ARGUMENT)
    t.data = cnp.PyArray_DATA(arr)
    t.count = cnp.PyArray_SIZE(arr)
    t.dtype = <gs_dtype_t><int>dt
    t.device.kind = GS_DEVICE_CPU
    t.device.id = 0
    return 0


cdef class TensorList:
    """A C array of gs_tensor_t describing Python arrays, which it keeps alive."""
    cdef gs_tensor_t *t
    cdef Py_ssize_t n
    cdef list arrays  # ndarrays viewing each object's memory

    def __cinit__(self):
        self.t = NULL
        self.n = 0

    def __dealloc__(self):
        PyMem_Free(self.t)

    cdef int load(self, list objs, str name, bint indexed, bint writable) except -1:
        cdef Py_ssize_t i, n = len(objs)
        self.t = <gs_tensor_t *>PyMem_Malloc(max(n, 1) * sizeof(gs_tensor_t))
        if self.t == NULL:
            raise MemoryError()
        self.n = n
        self.arrays = objs
        for i in range(n):
            obj = objs[i]
            if type(obj) is not np.ndarray:
                if self.arrays is objs:
                    self.arrays = list(objs)
                obj = as_ndarray(obj, label(name, i, indexed))
                self.arrays[i] = obj
            fill_tensor(&self.t[i], obj, name, i, indexed, writable)
        return 0
