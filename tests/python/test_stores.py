"""The stores a joined world keeps (issue 48): gradsync._filestore.FileStore
(GRADSYNC_STORE_DIR, gradsyncrun's elastic mode) gives torch's Store
semantics, its add and compare_set atomic across processes, and a lock
left by a holder that died is broken; _rendezvous.BoundedStore ends every
call within its time (a store across a downed link blocks for minutes),
passes errors through, and lacks what the store lacks. Process-local: no
communication."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gradsync import JoinError
from gradsync._filestore import FileStore
from gradsync._rendezvous import BoundedStore
from gsutil import child_env


def test_file_store_calls_as_torch_has_them(tmp_path):
    s = FileStore(tmp_path / "store")
    assert not s.check(["a/b"])
    s.set("a/b", b"x")
    s.set("a/c", "text")  # str is stored as its UTF-8 bytes
    assert s.check(["a/b", "a/c"]) and s.get("a/b") == b"x" and s.get("a/c") == b"text"
    with pytest.raises(KeyError):
        s.get("missing")
    assert s.add("n", 3) == 3 and s.add("n", 0) == 3 and s.add("n", -1) == 2
    assert s.compare_set("k", b"", b"first") == b"first"    # none: set
    assert s.compare_set("k", b"", b"second") == b"first"   # not expected: unchanged
    assert s.compare_set("k", b"first", b"third") == b"third"
    assert s.get("k") == b"third"
    # keys with the separator characters map to distinct files
    s.set("x%2Fy", b"1")
    s.set("x/y", b"2")
    assert (s.get("x%2Fy"), s.get("x/y")) == (b"1", b"2")


# Child processes are started afresh (python -c), not forked: the pytest
# process may hold threads (JAX's, MPI's), and a fork copies their locks.
ADDER = """
import os, sys
from gradsync._filestore import FileStore
s = FileStore(sys.argv[1])
for _ in range(int(sys.argv[2])):
    s.add("count", 1)
s.compare_set("winner", b"", str(os.getpid()).encode())
"""

HOLDER = """
import os, signal, sys
from gradsync._filestore import FileStore
s = FileStore(sys.argv[1])
fd = os.open(s._file("n") + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
os.write(fd, str(os.getpid()).encode())
os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lock
"""


def _python(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=child_env())


def test_file_store_add_and_compare_set_are_atomic_across_processes(tmp_path):
    path = tmp_path / "store"
    FileStore(path)
    procs = [_python(ADDER, path, 200) for _ in range(4)]
    for p in procs:
        assert p.wait(120) == 0
    s = FileStore(path)
    assert s.add("count", 0) == 800
    assert int(s.get("winner")) in {p.pid for p in procs}  # one of them, whole


def test_file_store_breaks_the_lock_of_a_holder_that_died(tmp_path):
    s = FileStore(tmp_path / "store")
    s.add("n", 1)
    assert _python(HOLDER, tmp_path / "store").wait(120) == -signal.SIGKILL
    assert os.path.exists(s._file("n") + ".lock")
    t0 = time.monotonic()
    assert s.add("n", 1) == 2  # not a wait for ever
    assert time.monotonic() - t0 < 10


class _Hanging:
    """A store whose add never returns (a TCPStore across a downed link)."""

    def __init__(self):
        self.release = threading.Event()
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def add(self, key, amount):
        self.release.wait()
        return amount


def test_bounded_store_ends_a_call_that_does_not_answer():
    inner = _Hanging()
    s = BoundedStore(inner, 0.3)
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.check(["a"])
    with pytest.raises(KeyError):  # the store's own errors come through as they are
        s.get("b")
    t0 = time.monotonic()
    with pytest.raises(JoinError, match=r"did not answer \(add\) in 0.3 s"):
        s.add("n", 1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(JoinError):  # its thread may still be blocked: every later call fails
        s.get("a")
    inner.release.set()


def test_bounded_store_lacks_what_the_store_lacks():
    class SetGetOnly:
        def set(self, key, value):
            pass

        def get(self, key):
            return b""

        def check(self, keys):
            return True

    s = BoundedStore(SetGetOnly(), 1)
    assert not callable(getattr(s, "add", None))
    assert not callable(getattr(s, "compare_set", None))
    assert callable(getattr(BoundedStore(FileStore.__new__(FileStore), 1), "add", None))
