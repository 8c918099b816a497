# Gradient control kernels (included by _core.pyx): convert, check, call C.

cdef TensorList host_tensors(tensors, str name, bint writable, str call=None):
    cdef bint indexed = type(tensors) is list or type(tensors) is tuple
    cdef TensorList tl = TensorList()
    tl.load(list(tensors) if indexed else [tensors], name, indexed, writable, call)
    return tl


def zero_(tensors):
    """Sets every element's bits to 0."""
    cdef TensorList tl = host_tensors(tensors, "tensors", True, "gs.zero_")
    with nogil:
        CHKERR(gs_zero(tl.t, tl.n))


def accumulate_(acc, grad, bint overwrite, bint run=True):
    """acc += grad (or acc = grad) pairwise; run=False only checks arguments."""
    acc_list = type(acc) is list or type(acc) is tuple
    if acc_list != (type(grad) is list or type(grad) is tuple):
        raise ArgumentError("acc and grad must both be arrays or both be lists",
                            GS_ERR_INVALID_ARGUMENT)
    if acc_list and len(acc) != len(grad):
        raise ArgumentError(f"acc has {len(acc)} tensors but grad has {len(grad)}",
                            GS_ERR_INVALID_ARGUMENT)
    cdef TensorList ta = host_tensors(acc, "acc", True, "gs.accumulate_")
    cdef TensorList tg = host_tensors(grad, "grad", False)
    if not run:
        return
    with nogil:
        CHKERR(gs_accumulate(ta.t, tg.t, ta.n, overwrite))


def all_finite(tensors):
    """True when no element is NaN or infinite."""
    cdef int finite = 1
    cdef TensorList tl = host_tensors(tensors, "tensors", False)
    with nogil:
        CHKERR(gs_all_finite(tl.t, tl.n, &finite))
    return bool(finite)


def scale_(tensors, double factor):
    """x *= factor, rounded once."""
    cdef TensorList tl = host_tensors(tensors, "tensors", True, "gs.scale_")
    with nogil:
        CHKERR(gs_scale(tl.t, tl.n, factor))
