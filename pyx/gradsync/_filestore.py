"""A rendezvous store in a folder, for worlds joined without torch
(gradsyncrun's elastic mode, GRADSYNC_STORE_DIR; docs/GUIDE.md section 2.16).

The calls gradsync's join, shrink and grow use, with torch's Store
semantics: ``set``, ``get``, ``check``, ``add`` and ``compare_set``. Every
key is a file, written whole and renamed into place (a reader never sees a
half-written value); ``add`` and ``compare_set`` hold a lock file made with
O_EXCL. Local folders and shared file systems with atomic rename and
O_EXCL (NFSv3 and later) both work; the folder is the caller's to remove.
"""
import contextlib
import os
import time

_LOCK_POLL_SECONDS = 0.001


class FileStore:
    """torch.distributed.Store's calls over files in ``path`` (made if missing)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)

    def _file(self, key):
        return os.path.join(self.path, key.replace("%", "%25").replace("/", "%2F"))

    def set(self, key, value):
        value = value if isinstance(value, bytes) else str(value).encode()
        tmp = f"{self._file(key)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def get(self, key):
        """The value of ``key`` (KeyError when it has none: this store does
        not wait, gradsync's callers poll ``check``)."""
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyError(key) from None

    def check(self, keys):
        return all(os.path.exists(self._file(k)) for k in keys)

    def add(self, key, amount):
        """The integer value of ``key`` (0 when none) plus ``amount``, stored
        and returned."""
        with self._locked(key):
            value = int(self.get(key)) if self.check([key]) else 0
            value += int(amount)
            self.set(key, str(value).encode())
            return value

    def compare_set(self, key, expected, desired):
        """Sets ``desired`` when the value is ``expected`` (b"" also when
        there is none); returns the value after."""
        with self._locked(key):
            current = self.get(key) if self.check([key]) else b""
            if current == expected:
                self.set(key, desired)
                current = desired
            return current

    @contextlib.contextmanager
    def _locked(self, key):
        lock = self._file(key) + ".lock"
        waits = 0
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                waits += 1
                if waits % 100 == 0:
                    _break_if_orphaned(lock)
                time.sleep(_LOCK_POLL_SECONDS)
        try:
            os.write(fd, f"{os.getpid()}".encode())
            yield
        finally:
            os.close(fd)
            os.unlink(lock)


def _break_if_orphaned(lock):
    """Removes a lock whose holder on this host has died holding it (a rank
    SIGKILLed inside add): otherwise every later add would wait for ever."""
    try:
        with open(lock, "rb") as f:
            pid = int(f.read() or b"0")
        before = os.stat(lock)
        if pid > 0:
            os.kill(pid, 0)
    except ProcessLookupError:
        with contextlib.suppress(OSError):
            if os.stat(lock).st_ino == before.st_ino:  # not a new holder's lock
                os.unlink(lock)
    except (OSError, ValueError):
        pass
