"""gradsync.horovod's errors: Horovod's HorovodInternalError and the classes
under it, and how a failed gradsync collective becomes one of them (the
engine's docstring, gradsync.horovod.engine, says when each is raised)."""
import gradsync as gs


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's error class: a RuntimeError)."""


class MismatchError(HorovodInternalError, gs.MismatchError):
    """The ranks did not make the same call (a gs.MismatchError that is also
    Horovod's HorovodInternalError). No tensor was written."""

    def __init__(self, message="", status=None):
        HorovodInternalError.__init__(self, message)
        self.status = int(status) if status is not None else 3


class JoinedError(HorovodInternalError):
    """A collective that needs data from every rank ran while some ranks had
    called join()."""


class ShutdownError(HorovodInternalError):
    """gradsync.horovod has been shut down on this rank or another."""


class _Abandoned(Exception):
    """The executor was told to stop (shutdown) while it waited."""


def _translate(exc, call):
    """Horovod raises HorovodInternalError (a RuntimeError) for collectives
    that fail across ranks; argument errors found on this rank keep their
    own class (ValueError, TypeError)."""
    if isinstance(exc, gs.MismatchError) and not isinstance(exc, MismatchError):
        err = MismatchError(f"{call}: the ranks' operations of this name differ: {exc}",
                            exc.status)
        err.__cause__ = exc
        return err
    if isinstance(exc, gs.Error) and not isinstance(exc, (ValueError, TypeError)):
        err = HorovodInternalError(f"{call}: {exc}")
        err.__cause__ = exc
        return err
    return exc
