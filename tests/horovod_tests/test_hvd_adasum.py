"""op=hvd.Adasum: the assertions of Horovod's test_adasum_pytorch.py, on the
CPU. Orthogonal gradients add up; parallel ones average (the balanced tree
of a power-of-two number of ranks, which is all Horovod supports; gradsync
also runs other counts, where the fold-in pairs make a different, still
scale-equivariant, combination)."""
import numpy as np
import pytest
from hvdtest import Checks, hvd, torch

pytestmark = pytest.mark.mpi
POWER_OF_TWO = hvd.size() & (hvd.size() - 1) == 0
DATA_TYPES = [np.float32, np.float16]


def diff_ratio(true_vec, comp_vec):
    return np.linalg.norm(true_vec - comp_vec) / np.linalg.norm(true_vec) / 100.0


def are_close(data_type, true_vec, comp_vec):
    return diff_ratio(true_vec, comp_vec) < np.finfo(data_type).eps


def _reduce(columns, data_type):
    """Each rank reduces its column of every matrix; returns the results."""
    tensors = [torch.from_numpy(q.astype(data_type)[:, hvd.rank()].copy()) for q in columns]
    handles = [hvd.allreduce_async(t, op=hvd.Adasum) for t in tensors]
    return [hvd.synchronize(h).double().numpy() for h in handles]


def test_orthogonal():
    c, size = Checks(), hvd.size()
    np.random.seed(2)
    for data_type in DATA_TYPES:
        qs = []
        for n in [size * 20 - 17, size * 2 + 1, size + 2, 2**19]:
            q, _ = np.linalg.qr(np.random.normal(0, 1, (n, size)))
            qs.append(q.astype(data_type).astype(np.float64))
        for q, got in zip(qs, _reduce(qs, data_type)):
            c.check(are_close(data_type, q.sum(axis=1), got),
                    f"{data_type.__name__} n={q.shape[0]}: off by {diff_ratio(q.sum(axis=1), got)}")
    c.done()


@pytest.mark.skipif(not POWER_OF_TWO, reason="Horovod's Adasum: a power-of-two rank count")
def test_parallel():
    c, size = Checks(), hvd.size()
    np.random.seed(2)
    for data_type in DATA_TYPES:
        qs = []
        for n in [size * 20 - 13, size * 2 + 1, size + 2, 2**19]:
            a = np.random.normal(0, 1, (n, 1))
            r = np.random.normal(0, 1, (size, 1))
            qs.append(np.dot(a, r.T).astype(data_type).astype(np.float64))
        for q, got in zip(qs, _reduce(qs, data_type)):
            want = q.sum(axis=1) / size
            c.check(are_close(data_type, want, got),
                    f"{data_type.__name__} n={q.shape[0]}: off by {diff_ratio(want, got)}")
    c.done()


@pytest.mark.skipif(not POWER_OF_TWO, reason="Horovod's Adasum: a power-of-two rank count")
def test_stability():
    """Parallel vectors of magnitude near the dtype's smallest normal
    number still average (no underflow in the dot products)."""
    c, size, rank = Checks(), hvd.size(), hvd.rank()
    np.random.seed(2)
    for data_type in DATA_TYPES:
        a = np.random.normal(0, np.finfo(data_type).tiny, (1024, 1))
        r = np.random.normal(0, 1, (size, 1))
        q = np.dot(a, r.T).astype(data_type).astype(np.float64)
        tensor = torch.from_numpy(q[:, rank].astype(data_type))
        hvd.allreduce_(tensor, op=hvd.Adasum)
        want = q.sum(axis=1) / size
        c.check(are_close(data_type, want, tensor.double().numpy()),
                f"{data_type.__name__}: off by {diff_ratio(want, tensor.double().numpy())}")
    c.done()
