"""A DLPack producer written with ctypes, independent of NumPy's and
gradsync's own exports: it hands out 1.x (versioned) or legacy capsules over
a NumPy array's memory, with the flags the test chooses (READ_ONLY,
IS_COPIED), and counts the deleter calls of the capsules it made."""
import ctypes

import numpy as np

READ_ONLY = 1 << 0
IS_COPIED = 1 << 1

_KDLCPU = 1
_CODES = {"i": 0, "u": 1, "f": 2}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _Managed(ctypes.Structure):
    pass


class _ManagedVersioned(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                     ("deleter", _DELETER)]
_ManagedVersioned._fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p),
                              ("deleter", _DELETER), ("flags", ctypes.c_uint64),
                              ("dl_tensor", _Tensor)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class CtypesProducer:
    """``CtypesProducer(arr, versioned=True, flags=READ_ONLY)``: ``arr`` is a
    C-contiguous host NumPy array (the memory itself stays writable: only the
    export says otherwise). ``deleted`` counts deleter calls, ``exported``
    capsules made; every consumer must call the deleter exactly once."""

    def __init__(self, arr, versioned=True, flags=READ_ONLY):
        assert arr.flags.c_contiguous and arr.dtype.kind in _CODES
        self.arr = arr
        self.versioned = versioned
        self.flags = flags
        self.exported = 0
        self.deleted = 0
        self._live = {}  # address of a managed struct -> what it keeps alive
        self._deleter = _DELETER(self._delete)

    def _delete(self, address):
        self.deleted += 1
        self._live.pop(address, None)

    def __dlpack_device__(self):
        return (_KDLCPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.arr
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        managed = _ManagedVersioned() if self.versioned else _Managed()
        t = managed.dl_tensor
        t.data = a.ctypes.data
        t.device = _Device(_KDLCPU, 0)
        t.ndim = a.ndim
        t.dtype = _DataType(_CODES[a.dtype.kind], a.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None  # compact C order
        t.byte_offset = 0
        managed.deleter = self._deleter
        if self.versioned:
            managed.version = _Version(1, 0)
            managed.flags = self.flags
        address = ctypes.addressof(managed)
        self._live[address] = (managed, shape)
        self.exported += 1
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        return _capsule_new(address, name, None)


def writable_twin(arr):
    """Checks the producer itself: the same export without READ_ONLY must
    be writable to NumPy (so the flag, not the producer, decides)."""
    p = CtypesProducer(arr, versioned=True, flags=0)
    view = np.from_dlpack(p)
    return view.flags.writeable and view.ctypes.data == arr.ctypes.data
