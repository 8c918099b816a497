"""Helpers shared by the tests/horovod modules: Horovod's dtype lists and
thresholds, and local checks gathered into one collective verdict."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradsync.horovod.torch as hvd  # noqa: E402
from gsutil import collective_assert  # noqa: E402

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

    def done(self):
        collective_assert(not self.failures, "\n".join(self.failures[:8]))
