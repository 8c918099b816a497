# Status codes to Python exceptions (included by _core.pyx).

class Error(Exception):
    """Base class of gradsync's errors; ``status`` holds the C status code."""

    def __init__(self, message="", status=GS_ERR_INTERNAL):
        super().__init__(message)
        self.status = int(status)

    def __reduce__(self):
        return (type(self), (str(self), self.status))


class MismatchError(Error):
    """The ranks made different calls (or another rank rejected its arguments).

    Raised on every rank; no tensor was written."""


class ArgumentError(Error, ValueError):
    """A bad argument value: non-contiguous, read-only, wrong size, bad root."""


class DtypeError(Error, TypeError):
    """An unsupported dtype, or an op that needs another dtype."""


class UnsupportedError(Error):
    """Valid, but not available in this build (for example CUDA memory)."""


class ClosedError(Error):
    """The communicator was closed."""


_STATUS_CLASSES = {
    GS_ERR_INVALID_ARGUMENT: ArgumentError,
    GS_ERR_TYPE: DtypeError,
    GS_ERR_MISMATCH: MismatchError,
    GS_ERR_UNSUPPORTED: UnsupportedError,
    GS_ERR_CLOSED: ClosedError,
}


cdef object error_for(gs_status_t s):
    msg = gs_last_error().decode("utf-8", "replace") or gs_status_string(s).decode()
    if s == GS_ERR_NO_MEMORY:
        return MemoryError(msg)
    return _STATUS_CLASSES.get(s, Error)(msg, s)


cdef inline int CHKERR(gs_status_t s) except -1 nogil:
    if s == GS_SUCCESS:
        return 0
    with gil:
        raise error_for(s)


cdef gs_status_t status_of(exc):
    """The status an exception raised while converting arguments stands for."""
    if isinstance(exc, Error):
        return <gs_status_t>exc.status
    if isinstance(exc, TypeError):
        return GS_ERR_TYPE
    if isinstance(exc, MemoryError):
        return GS_ERR_NO_MEMORY
    return GS_ERR_INVALID_ARGUMENT
