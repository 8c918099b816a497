"""Helpers for tests that start processes of their own and join them into
one world with gs.init (no launcher: a killed process does not take the
others down with it)."""
import ctypes
import os
import struct

import numpy as np

from gradsync._filestore import FileStore

# The rendezvous gs.init needs (set, get, check; add and compare_set for
# shrink and grow), as files in a folder: gradsync's own.
DirStore = FileStore


# ---- the elastic tests' training (test_shrink.py, tests/cluster/elastic_job.py):
# whole-number gradients, so every order of summation gives the same float32
# bits, and the survivors' weights can be replayed from the members of each step

def gradient(step, who, n):
    """Process ``who``'s gradient at ``step``."""
    return ((step + 1) * (who + 1) + np.arange(n) % 7).astype(np.float32)


def train_step(state, comm, who, members, wire=None):
    """One step on gradsync.elastic.State(w=..., step=..., history=[]): the
    members' gradients summed (on ``wire``: bfloat16 holds these whole
    numbers and their sums exactly), subtracted; the members noted;
    committed."""
    g = gradient(state.step, who, state.w.size)
    comm.allreduce_(g, wire=wire)
    state.w -= g
    state.history.append(members)
    state.step += 1
    state.commit()


def replay(history, n):
    """The weights train_step leaves after ``history`` (each step's members),
    computed in float64 (exact: whole numbers)."""
    w = np.zeros(n)
    for step, members in enumerate(history):
        for who in members:
            w -= gradient(step, who, n)
    return w.astype(np.float32)


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
