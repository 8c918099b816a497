# The DLPack 1.x exchange structs (https://github.com/dmlc/dlpack, dlpack.h),
# declared here rather than taken from a header: Cython emits the definitions,
# so building gradsync needs no copy of dlpack.h. Layout and values follow the
# specification; only what gradsync reads or writes is named.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

# The ABI version gradsync produces and understands (major must match).
cdef enum:
    DLPACK_MAJOR_VERSION = 1
    DLPACK_MINOR_VERSION = 0

# DLManagedTensorVersioned.flags
cdef enum:
    DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
    DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1

# DLDeviceType (int32 in the structs below)
cdef enum:
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLROCM = 10
    kDLCUDAManaged = 13

# DLDataTypeCode
cdef enum:
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6

ctypedef struct DLPackVersion:
    uint32_t major
    uint32_t minor

ctypedef struct DLDevice:
    int32_t device_type      # a DLDeviceType
    int32_t device_id        # the CUDA ordinal; 0 for host, pinned and managed memory

ctypedef struct DLDataType:
    uint8_t code             # a DLDataTypeCode
    uint8_t bits
    uint16_t lanes

ctypedef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides         # in elements; NULL (legacy capsules): C-contiguous
    uint64_t byte_offset

# Legacy (pre-1.0) capsules, named "dltensor" / "used_dltensor".
cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void *manager_ctx
    void (*deleter)(DLManagedTensor *self) noexcept nogil

# DLPack 1.x capsules, named "dltensor_versioned" / "used_dltensor_versioned".
# Everything up to flags stays where it is in every future major version, so
# the deleter can always be called.
cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void *manager_ctx
    void (*deleter)(DLManagedTensorVersioned *self) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor

# The C exchange API of DLPack 1.3: a producer type's __dlpack_c_exchange_api__
# is a PyCapsule named "dlpack_exchange_api" holding a DLPackExchangeAPI*
# that stays valid for the life of the process. gradsync uses the two calls
# that read a tensor without Python-level work; the others keep their places.
ctypedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out) except -1
ctypedef int (*DLPackCurrentWorkStream)(int32_t device_type, int32_t device_id,
                                        void **out_current_stream) except -1

cdef struct DLPackExchangeAPIHeader:
    DLPackVersion version
    DLPackExchangeAPIHeader *prev_api

ctypedef struct DLPackExchangeAPI:
    DLPackExchangeAPIHeader header
    void *managed_tensor_allocator
    void *managed_tensor_from_py_object_no_sync
    void *managed_tensor_to_py_object_no_sync
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync  # may be NULL
    DLPackCurrentWorkStream current_work_stream
