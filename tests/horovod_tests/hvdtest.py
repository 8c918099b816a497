"""Helpers shared by the tests/horovod_tests modules: Horovod's dtype lists and
thresholds, and local checks gathered into one collective verdict."""
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradsync.horovod.torch as hvd  # noqa: E402
from gsutil import WORLD, collective_assert  # noqa: E402

hvd.init()

INTS = [torch.int32, torch.int64]
FLOATS = [torch.float32, torch.float64, torch.float16]
REDUCE_DTYPES = INTS + FLOATS                              # Int, Long, Float, Double, Half
MOVE_DTYPES = [torch.uint8, torch.int8, torch.int16] + INTS + FLOATS  # + Byte, Char, Short
DIMS = [1, 2, 3]


def threshold(size, dtype):
    """Horovod's tolerance: exact up to 3 ranks and for integers."""
    if size <= 3 or dtype in INTS:
        return 0
    return 1e-4 if size < 10 else 5e-4


def as_float(*tensors):
    """Horovod's convert_cpu_fp16_to_fp32."""
    return [t.float() if t.dtype == torch.float16 else t for t in tensors]


def random_tensor(dims, seed=1234):
    """torch.FloatTensor(*dims).random_(-100, 100) after manual_seed(1234)."""
    torch.manual_seed(seed)
    return torch.FloatTensor(*dims).random_(-100, 100)


def even_odd_sets():
    """((my set's ranks, my set), all sets): even and odd ranks. Sets that an
    earlier failed test left registered are removed first."""
    from gradsync.horovod import state

    for ps in state.process_sets():
        if ps is not hvd.global_process_set:
            hvd.remove_process_set(ps)
    rank, size = hvd.rank(), hvd.size()
    even = [r for r in range(size) if r % 2 == 0]
    odd = [r for r in range(size) if r % 2 == 1]
    even_set = hvd.add_process_set(even) if len(even) < size else hvd.global_process_set
    odd_set = hvd.add_process_set(odd) if odd else None
    mine = (even, even_set) if rank % 2 == 0 else (odd, odd_set)
    return mine, [s for s in (even_set, odd_set) if s is not None]


def remove_sets(sets):
    for s in sets:
        if s is not hvd.global_process_set:
            hvd.remove_process_set(s)


class Checks:
    """Local checks, failed collectively at the end (no rank stops early)."""

    def __init__(self):
        self.failures = []
        self.folders = []  # submitted_pending's, removed by done()

    def check(self, ok, what):
        if not bool(ok):
            self.failures.append(str(what))

    def raises(self, exc_types, fn, what):
        try:
            fn()
        except exc_types:
            return
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
            return
        self.failures.append(f"{what}: did not raise")

    def grad_close(self, got, expected, what):
        err = np.linalg.norm(np.asarray(expected, np.float64) - got.detach().double().numpy())
        self.check(err < 1e-8, f"{what}: gradient error {err}")

    def submitted_pending(self, submit, what="hvd.poll()"):
        """Asynchrony observed without timing: returns ``submit()``'s handle,
        checking on rank 0 that it polls False while the operation cannot
        have finished. The last rank submits only after rank 0 has polled
        (it waits, at most a minute, for a file rank 0 then writes), so the
        collective still lacks that rank's part when rank 0 polls."""
        rank, size = hvd.rank(), hvd.size()
        if size == 1:
            return submit()
        folder = WORLD.bcast(tempfile.mkdtemp(prefix="gs-hvd-poll-") if rank == 0 else None)
        polled = os.path.join(folder, "polled")
        if rank == size - 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(polled) and time.monotonic() < deadline:
                time.sleep(0.001)
            self.check(os.path.exists(polled), "rank 0 never signalled that it had polled")
        handle = submit()
        if rank == 0:
            self.check(not hvd.poll(handle),
                       f"{what} was True before the last rank submitted: not asynchronous?")
            open(polled, "w").close()
        self.folders.append(folder)
        return handle

    def done(self):
        try:  # after this exchange every rank is past its submitted_pending
            collective_assert(not self.failures, "\n".join(self.failures[:8]))
        finally:
            if hvd.rank() == 0:
                for folder in self.folders:
                    shutil.rmtree(folder, ignore_errors=True)
