# Where memory lives and moving it (included by _core.pyx before
# _device.pxi): CUDA device arguments checked and parsed into gs_device_t,
# gs_memcpy between any two memories in stream order, and new arrays in the
# same kind of memory as another.

cdef enum:
    LEGACY_STREAM = 1  # the legacy default stream, as DLPack and gs_cuda_set_stream number it


cdef int cuda_ordinal(object device, str what) except -1:
    """Checks that CUDA device `device` (None: the current one) exists."""
    cdef int n = 0, current = 0
    CHKERR(gs_cuda_device_count(&n))
    if not gs_cuda_built():
        raise UnsupportedError(f"{what}: CUDA memory needs a gradsync built with CUDA (nvcc "
                               "present when it was built); this build is CPU-only. "
                               "device='cpu' gives host memory", GS_ERR_UNSUPPORTED)
    if n == 0:
        raise Error(f"{what}: no CUDA device is visible to this process (check the driver "
                    "and CUDA_VISIBLE_DEVICES); device='cpu' gives host memory", GS_ERR_CUDA)
    if device is None:
        CHKERR(gs_cuda_get_device(&current))
        return current
    if device < 0 or device >= n:
        raise ArgumentError(f"{what}: CUDA device {device} does not exist; this process sees "
                            f"{n} CUDA device{'s' if n != 1 else ''}", GS_ERR_INVALID_ARGUMENT)
    return device


cdef gs_device_t parse_device(object device, str what) except *:
    """None or 'cuda': the current CUDA device; an int or 'cuda:N': CUDA device
    N; 'cpu': host memory; 'cuda_host': pinned host memory; a DLPack
    (kind, id) tuple: that device."""
    cdef gs_device_t d
    d.kind = GS_DEVICE_CUDA
    d.id = 0
    if device is None:
        d.id = cuda_ordinal(None, what)
    elif isinstance(device, str):
        s = device.strip().lower()
        if s == "cpu":
            d.kind = GS_DEVICE_CPU
        elif s in ("cuda_host", "pinned"):
            d.kind = GS_DEVICE_CUDA_HOST
        elif s == "cuda":
            d.id = cuda_ordinal(None, what)
        elif s.startswith("cuda:") and s[5:].isdigit():
            d.id = cuda_ordinal(int(s[5:]), what)
        else:
            raise ArgumentError(f"{what}: device {device!r} is not one of 'cpu', 'cuda', "
                                "'cuda:N', 'cuda_host'", GS_ERR_INVALID_ARGUMENT)
    elif isinstance(device, tuple) and len(device) == 2:
        kind, ordinal = int(device[0]), int(device[1])
        if kind == kDLCPU or kind == kDLCUDAHost:
            d.kind = GS_DEVICE_CPU if kind == kDLCPU else GS_DEVICE_CUDA_HOST
        elif kind == kDLCUDA:
            d.id = cuda_ordinal(ordinal, what)
        else:
            raise ArgumentError(f"{what}: DLPack device {device} is not host (1), CUDA (2) or "
                                "pinned host (3) memory", GS_ERR_INVALID_ARGUMENT)
    elif isinstance(device, int) and not isinstance(device, bool):
        d.id = cuda_ordinal(device, what)
    else:
        raise TypeError(f"{what}: device must be None, a CUDA ordinal, 'cpu', 'cuda', "
                        f"'cuda:N', 'cuda_host' or a DLPack (kind, id) tuple, not {device!r}")
    return d


cdef int copy_memory(object dst, TensorList src, uintptr_t work=0) except -1:
    """dst (an ndarray or a _TensorRef of src's one array's size) takes its
    bytes, on the legacy default stream after the call's work stream (`work`,
    else src's; gs_memcpy). A DeviceArray destination is written after every
    recorded use and records the copy as its last write; a DeviceArray
    source records the read."""
    cdef void *p
    cdef gs_device_t dev
    cdef const gs_tensor_t *t = &src.t[0]
    cdef size_t nbytes = <size_t>t.count * gs_dtype_size(t.dtype)
    cdef gs_mem_t mem = NULL
    if work == 0:
        work = src.work_stream
    if isinstance(dst, _TensorRef):
        p = (<_TensorRef>dst).data
        dev = (<_TensorRef>dst).dev
        if isinstance(dst, DeviceArray) and dev.kind == GS_DEVICE_CUDA:
            mem = (<DeviceArray>dst).mem
            CHKERR(gs_mem_order(&mem, 1, work, 1))
    else:
        p = cnp.PyArray_DATA(<cnp.ndarray>dst)
        dev.kind = GS_DEVICE_CPU
        dev.id = 0
    gs_cuda_set_stream(work)  # this call's
    with nogil:
        CHKERR(gs_memcpy(p, dev, t.data, t.device, nbytes))
    if mem != NULL:
        CHKERR(gs_mem_use(&mem, 1, LEGACY_STREAM, 1))
    if src.nmems:
        CHKERR(gs_mem_use(src.mems, src.nmems, LEGACY_STREAM, 0))
    return 0


cdef object new_array(object like, tuple shape):
    """A new, uninitialised array of like's dtype in like's kind of memory: a
    DeviceArray on like's CUDA device, else a numpy.ndarray."""
    if isinstance(like, _TensorRef) and (<_TensorRef>like).dev.kind == GS_DEVICE_CUDA:
        return DeviceArray(shape, like.dtype, (kDLCUDA, (<_TensorRef>like).dev.id))
    return np.empty(shape, dtype=like.dtype)
