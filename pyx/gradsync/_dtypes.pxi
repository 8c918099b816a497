# gradsync's dtypes as NumPy and DLPack name them, and the helpers every
# argument reader shares (labels, device words, CHKERR while reading an
# argument). Included by _core.pyx before _dlpack.pxi and _tensors.pxi.

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
