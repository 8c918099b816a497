# Gradient control kernels (included by _core.pyx): convert, check, call C.
# The kernels name one array "tensors" in errors, as a list's (arguments(one=)).
# They queue on the call's work stream and return: the DeviceArrays among
# the arguments record that stream's use (TensorList.used).

def zero_(tensors):
    """Sets every element's bits to 0."""
    cdef TensorList tl = arguments(tensors, "tensors", True, "gs.zero_", "tensors")
    with nogil:
        CHKERR(gs_zero(tl.t, tl.n))
    tl.used(tl.work_stream)


def accumulate_(acc, grad, bint overwrite, bint run=True):
    """acc += grad (or acc = grad) pairwise; run=False only checks arguments."""
    acc_list = type(acc) is list or type(acc) is tuple
    if acc_list != (type(grad) is list or type(grad) is tuple):
        raise ArgumentError("acc and grad must both be arrays or both be lists",
                            GS_ERR_INVALID_ARGUMENT)
    if acc_list and len(acc) != len(grad):
        raise ArgumentError(f"acc has {len(acc)} tensors but grad has {len(grad)}",
                            GS_ERR_INVALID_ARGUMENT)
    cdef TensorList ta = arguments(acc, "acc", True, "gs.accumulate_")
    cdef TensorList tg = arguments(grad, "grad", False, None, None, ta)
    if not run:
        return
    with nogil:
        CHKERR(gs_accumulate(ta.t, tg.t, ta.n, overwrite))
    ta.used(tg.work_stream)
    tg.used(tg.work_stream)


def all_finite(tensors):
    """True when no element is NaN or infinite."""
    cdef int finite = 1
    cdef TensorList tl = arguments(tensors, "tensors", False, None, "tensors")
    with nogil:
        CHKERR(gs_all_finite(tl.t, tl.n, &finite))
    return bool(finite)


def scale_(tensors, double factor):
    """x *= factor, rounded once."""
    cdef TensorList tl = arguments(tensors, "tensors", True, "gs.scale_", "tensors")
    with nogil:
        CHKERR(gs_scale(tl.t, tl.n, factor))
    tl.used(tl.work_stream)
