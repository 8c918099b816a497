"""hvd.alltoall: the numerical assertions of Horovod's test_torch.py for it
(equal and explicit splits, received splits, process sets, errors,
gradients), on the CPU."""
import itertools

import numpy as np
import pytest
from hvdtest import DIMS, MOVE_DTYPES, Checks, as_float, even_odd_sets, hvd, remove_sets, torch

pytestmark = pytest.mark.mpi


# ------------------------------------------------------------------ alltoall

def _alltoall_input(rank, ranks, dim, dtype):
    vals = []
    for i in ranks:
        vals += [i] * (rank + 1)
    tensor = torch.Tensor(vals)
    for _ in range(dim - 1):
        tensor = torch.cat((tensor.unsqueeze(1), tensor.unsqueeze(1)), dim=1)
    return tensor.to(dtype)


@pytest.mark.parametrize("with_splits", [True, False])
def test_alltoall(with_splits):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = _alltoall_input(rank, range(size), dim, dtype)
        if with_splits:
            splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
            collected, received = hvd.alltoall(tensor, splits)
            c.check(received.tolist() == [r + 1 for r in range(size)],
                    f"received splits {received.tolist()}")
        else:
            collected = hvd.alltoall(tensor)
        collected, = as_float(collected)
        c.check(collected.min() == rank and collected.max() == rank, f"{dtype} {dim}: values")
        c.check(collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1),
                f"{dtype} {dim}: {collected.numel()} values")
    c.done()


def test_alltoall_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = _alltoall_input(rank, ranks, dim, dtype)
        splits = torch.tensor([rank + 1] * len(ranks), dtype=torch.int32)
        collected, received = hvd.alltoall(tensor, splits, process_set=this_set)
        collected, = as_float(collected)
        c.check(collected.min() == rank and collected.max() == rank, f"{dtype} {dim}")
        c.check(collected.numel() == sum(r + 1 for r in ranks) * 2 ** (dim - 1), f"{dtype}")
        c.check(received.tolist() == [r + 1 for r in ranks], received.tolist())
    remove_sets(sets)
    c.done()


def test_alltoall_errors():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    c.raises(ValueError, lambda: hvd.alltoall(torch.empty(size - 1),
                                              torch.ones(size, dtype=torch.int32)),
             "splits add up to more than dim 0")
    c.raises(ValueError, lambda: hvd.alltoall(torch.empty(size),
                                              torch.empty(size, dtype=torch.float32)),
             "splits not int32")
    if size > 1:
        c.raises(ValueError, lambda: hvd.alltoall(torch.empty(size + 1)),
                 "dim 0 not a multiple of the size")
        tensor = torch.empty(size, dtype=torch.int32 if rank % 2 else torch.float32)
        c.raises(RuntimeError, lambda: hvd.alltoall(tensor), "different type")
        shape = [2 * size, 10 * (rank + 1), 2 * size]
        c.raises(RuntimeError, lambda: hvd.alltoall(torch.ones(shape)), "different dim 1")
    c.done()


@pytest.mark.parametrize("with_splits", [True, False])
def test_alltoall_grad(with_splits):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = _alltoall_input(rank, range(size), dim, dtype).requires_grad_()
        if with_splits:
            collected, _ = hvd.alltoall(tensor, torch.tensor([rank + 1] * size, dtype=torch.int32))
        else:
            collected = hvd.alltoall(tensor)
        collected.backward(torch.ones(collected.shape, dtype=dtype))
        c.grad_close(tensor.grad, np.ones(tensor.shape), f"{dtype} {dim}")
    c.done()
