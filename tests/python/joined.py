"""Helpers for tests that start processes of their own and join them into
one world with gs.init (no launcher: a killed process does not take the
others down with it). Imported by those processes, so it imports no MPI."""
import contextlib
import ctypes
import os
import struct
import time


class DirStore:
    """The rendezvous gs.init needs (set, get, check), as files in a folder."""

    def __init__(self, path):
        self.path = path

    def _file(self, key):
        return os.path.join(self.path, key.replace("/", "%"))

    def set(self, key, value):
        tmp = self._file(key) + ".%d.tmp" % os.getpid()
        with open(tmp, "wb") as f:
            f.write(value if isinstance(value, bytes) else str(value).encode())
        os.replace(tmp, self._file(key))

    def get(self, key):
        with open(self._file(key), "rb") as f:
            return f.read()

    def check(self, keys):
        return all(os.path.exists(self._file(k)) for k in keys)

    def compare_set(self, key, expected, desired):
        """torch's Store.compare_set: ``desired`` is set when the value is
        ``expected`` (b"" also when there is none); returns the value after."""
        with self._locked(key):
            current = self.get(key) if os.path.exists(self._file(key)) else b""
            if current == expected:
                self.set(key, desired)
                current = desired
            return current

    def add(self, key, amount):
        """torch's Store.add: the integer value (0 when none) plus ``amount``,
        stored and returned."""
        with self._locked(key):
            value = int(self.get(key)) if os.path.exists(self._file(key)) else 0
            value += int(amount)
            self.set(key, str(value).encode())
            return value

    @contextlib.contextmanager
    def _locked(self, key):
        """Atomic across processes: a lock file made with O_EXCL."""
        lock = self._file(key) + ".lock"
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                time.sleep(0.001)
        try:
            yield
        finally:
            os.close(fd)
            os.unlink(lock)


def deny_process_vm_readv():
    """Installs a seccomp filter on this process that fails process_vm_readv
    with EPERM (what Docker's default profile does without CAP_SYS_PTRACE)."""
    deny_syscall({"x86_64": 310, "aarch64": 270})


def deny_memfd_create():
    """Installs a seccomp filter on this process that fails memfd_create with
    EPERM (a sandbox that refuses anonymous shared files)."""
    deny_syscall({"x86_64": 319, "aarch64": 279})


def deny_syscall(numbers):
    """Installs a seccomp filter on this process that fails the system call
    numbered numbers[machine] with EPERM and allows every other."""
    nr = numbers[os.uname().machine]
    ld_nr, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    prog = [(ld_nr, 0, 0, 0), (jeq, 0, 1, nr), (ret, 0, 0, 0x00050000 | 1),  # ERRNO(EPERM)
            (ret, 0, 0, 0x7FFF0000)]  # ALLOW
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    fprog = Fprog(len(prog), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
