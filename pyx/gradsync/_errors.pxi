# Status codes to Python exceptions (included by _core.pyx).
import builtins

from cpython.exc cimport PyErr_Occurred
from cpython.pythread cimport PyThread_get_thread_ident

cdef extern from "Python.h":
    # declared without Cython's `except -1`: the handler's exception must stay
    # set for the collective's caller to raise, not be caught here
    int run_signal_handlers "PyErr_CheckSignals"()


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


class TimeoutError(Error, builtins.TimeoutError):
    """A collective waited past GRADSYNC_TIMEOUT_SECONDS (a rank died or stopped
    calling); the communicator is unusable afterwards."""


class PeerLostError(Error):
    """A peer's process is gone (killed, crashed, OOM-killed) while this rank
    waited for it. ``ranks`` names the lost ranks in the communicator's
    numbering. The communicator is unusable afterwards."""

    def __init__(self, message="", status=GS_ERR_PEER_LOST, ranks=()):
        super().__init__(message, status)
        self.ranks = tuple(int(r) for r in ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.status, self.ranks))


_STATUS_CLASSES = {
    GS_ERR_INVALID_ARGUMENT: ArgumentError,
    GS_ERR_TYPE: DtypeError,
    GS_ERR_MISMATCH: MismatchError,
    GS_ERR_UNSUPPORTED: UnsupportedError,
    GS_ERR_CLOSED: ClosedError,
    GS_ERR_TIMEOUT: TimeoutError,
    GS_ERR_PEER_LOST: PeerLostError,
}


cdef object error_for(gs_status_t s):
    msg = gs_last_error().decode("utf-8", "replace") or gs_status_string(s).decode()
    cdef int lost[64]
    if s == GS_ERR_PEER_LOST:
        n = gs_last_lost_ranks(lost, 64)
        return PeerLostError(msg, s, [lost[k] for k in range(min(n, 64))])
    return error_of_status(s, msg)


def error_of_status(int status, str message):
    """The exception gradsync raises for the gs_status_t ``status`` with
    ``message`` (for a binding that got the status another way: gradsync.jax
    reads it from JAX's runtime error)."""
    if status == GS_ERR_NO_MEMORY:
        return MemoryError(message)
    if status == GS_ERR_INTERRUPTED:
        return KeyboardInterrupt(message)
    return _STATUS_CLASSES.get(status, Error)(message, status)


cdef inline int CHKERR(gs_status_t s) except -1 nogil:
    if s == GS_SUCCESS:
        return 0
    with gil:
        if s == GS_ERR_INTERRUPTED and PyErr_Occurred() != NULL:
            return -1  # the signal handler's own exception (KeyboardInterrupt) goes up
        raise error_for(s)


# threads whose waits inside collectives are to end (abandon_waits)
cdef set _abandoned_threads = set()


def abandon_waits(thread_id, bint abandon=True):
    """Makes the thread ``thread_id`` (threading.get_ident()) leave any wait
    inside a collective within about 100 ms, with the interrupted error, its
    communicator then unusable (as Ctrl-C does); ``abandon=False`` clears
    the request. For a binding that shuts down while one of its threads
    waits for ranks that will not come."""
    if abandon:
        _abandoned_threads.add(int(thread_id))
    else:
        _abandoned_threads.discard(int(thread_id))


cdef int check_signals() noexcept nogil:
    """The runtime's interrupt check: runs Python's signal handlers (main
    thread only), so Ctrl-C inside a long collective raises promptly; ends
    the waits of threads given to abandon_waits()."""
    with gil:
        if _abandoned_threads and PyThread_get_thread_ident() in _abandoned_threads:
            return 1
        return run_signal_handlers() != 0


cdef gs_status_t status_of(exc):
    """The status an exception raised while converting arguments stands for."""
    if isinstance(exc, Error):
        return <gs_status_t>exc.status
    if isinstance(exc, TypeError):
        return GS_ERR_TYPE
    if isinstance(exc, MemoryError):
        return GS_ERR_NO_MEMORY
    return GS_ERR_INVALID_ARGUMENT
