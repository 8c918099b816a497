"""hvd.allgather, broadcast and reducescatter: the numerical assertions of
Horovod's test_torch.py for them (values, shapes, uneven first dimensions,
async, process sets, errors, gradients, grouped), on the CPU."""
import itertools

import numpy as np
import pytest
from hvdtest import (
    DIMS,
    FLOATS,
    INTS,
    MOVE_DTYPES,
    REDUCE_DTYPES,
    Checks,
    as_float,
    even_odd_sets,
    hvd,
    random_tensor,
    remove_sets,
    threshold,
    torch,
)

pytestmark = pytest.mark.mpi
needs_two = pytest.mark.skipif(hvd.size() == 1, reason="needs two ranks")
SIZES = [17, 32, 81, 12, 15, 23, 22]


def _rank_blocks(c, gathered, sizes, dim, values, what):
    c.check(list(gathered.shape) == [sum(sizes)] + [17] * (dim - 1),
            f"{what}: shape {list(gathered.shape)}")
    start = 0
    for n, v in zip(sizes, values):
        block = gathered[start:start + n]
        c.check(list(block.shape) == [n] + [17] * (dim - 1) and block.min() == v and
                block.max() == v, f"{what}: block of rank value {v}")
        start += n


# ----------------------------------------------------------------- allgather

def test_allgather():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype)
        gathered, = as_float(hvd.allgather(tensor))
        _rank_blocks(c, gathered, [17] * size, dim, range(size), f"{dtype} {dim}")
    c.done()


def test_allgather_variable_size():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    sizes = SIZES[:size]
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = torch.FloatTensor(*([sizes[rank]] + [17] * (dim - 1))).fill_(1).mul_(rank)
        gathered, = as_float(hvd.allgather(tensor.to(dtype)))
        _rank_blocks(c, gathered, sizes, dim, range(size), f"{dtype} {dim}")
    c.done()


def test_allgather_async_fused():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    tests = []
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype)
        tests.append((dtype, dim, hvd.allgather_async(tensor)))
    for dtype, dim, handle in tests:
        gathered, = as_float(hvd.synchronize(handle))
        _rank_blocks(c, gathered, [17] * size, dim, range(size), f"{dtype} {dim}")
    c.done()


def test_allgather_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim in itertools.product(MOVE_DTYPES, DIMS):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype)
        gathered, = as_float(hvd.allgather(tensor, process_set=this_set))
        _rank_blocks(c, gathered, [17] * len(ranks), dim, ranks, f"{dtype} {dim}")
    remove_sets(sets)
    c.done()


@needs_two
def test_allgather_errors():
    c, rank = Checks(), hvd.rank()
    shape = [17, 10 * (rank + 1), 17]
    c.raises(RuntimeError, lambda: hvd.allgather(torch.FloatTensor(*shape).fill_(1)),
             "different dim 1")
    tensor = torch.IntTensor(17, 17, 17) if rank % 2 == 0 else torch.FloatTensor(17, 17, 17)
    c.raises(RuntimeError, lambda: hvd.allgather(tensor), "different type")
    c.done()


def test_allgather_grad():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    sizes = [3, 2, 7, 4, 6, 8, 10][:size]
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = torch.FloatTensor(*([sizes[rank]] + [17] * (dim - 1))).fill_(1).mul_(rank)
        tensor = tensor.to(dtype).requires_grad_()
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=dtype) * r
                             for r, n in enumerate(sizes)])
        hvd.allgather(tensor).backward(grad_ys)
        c.grad_close(tensor.grad, np.ones([sizes[rank]] + [17] * (dim - 1)) * rank,
                     f"{dtype} {dim}")
    c.done()


def test_grouped_allgather_and_grad():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    sizes = [3, 2, 7, 4, 6, 8, 10][:size]
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensors = [torch.FloatTensor(*([sizes[rank]] + [17] * (dim - 1))).fill_(1).mul_(rank)
                   .to(dtype).requires_grad_() for _ in range(5)]
        gathered = hvd.grouped_allgather(tensors)
        for g in gathered:
            _rank_blocks(c, g.detach(), sizes, dim, range(size), f"{dtype} {dim}")
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=dtype) * r
                             for r, n in enumerate(sizes)])
        for g in gathered:
            g.backward(grad_ys)
        for t in tensors:
            c.grad_close(t.grad, np.ones([sizes[rank]] + [17] * (dim - 1)) * rank, f"{dtype}")
    c.done()


# ----------------------------------------------------------------- broadcast

@needs_two
@pytest.mark.parametrize("inplace", [False, True])
def test_broadcast(inplace):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product(MOVE_DTYPES, DIMS, range(size)):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype)
        root_tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(root).to(dtype)
        out = hvd.broadcast_(tensor, root) if inplace else hvd.broadcast(tensor, root)
        tensor, root_tensor, out = as_float(tensor, root_tensor, out)
        if inplace:
            c.check(out is not None and (tensor == out).min() == 1, "broadcast_ modifies")
        elif rank != root:
            c.check((tensor == root_tensor).max() == 0, "broadcast modified its source")
        c.check((out == root_tensor).min() == 1, f"{dtype} {dim} root {root}")
    c.done()


@needs_two
def test_broadcast_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim, root in itertools.product(MOVE_DTYPES, DIMS, ranks):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype)
        root_tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(root).to(dtype)
        out = hvd.broadcast(tensor, root, process_set=this_set)  # root: a global rank
        tensor, root_tensor, out = as_float(tensor, root_tensor, out)
        if rank != root:
            c.check((tensor == root_tensor).max() == 0, "broadcast modified its source")
        c.check((out == root_tensor).min() == 1, f"{dtype} {dim} root {root}")
    remove_sets(sets)
    c.done()


@needs_two
def test_broadcast_errors():
    c, rank = Checks(), hvd.rank()
    shape = [17, 10 * (rank + 1), 17]
    c.raises(RuntimeError, lambda: hvd.broadcast(torch.FloatTensor(*shape).fill_(1), 0),
             "different dim 1")
    tensor = torch.IntTensor(17, 17, 17) if rank % 2 == 0 else torch.FloatTensor(17, 17, 17)
    c.raises(RuntimeError, lambda: hvd.broadcast(tensor, 0), "different type")
    c.raises(RuntimeError, lambda: hvd.broadcast(torch.ones(17, 17, 17), rank),
             "different root")
    c.done()


@needs_two
def test_broadcast_grad():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product([torch.float32, torch.float64], DIMS, range(size)):
        tensor = torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype).requires_grad_()
        hvd.broadcast(tensor, root).backward(torch.ones([17] * dim, dtype=dtype))
        c.grad_close(tensor.grad, np.ones([17] * dim) * (1 if rank == root else 0),
                     f"{dtype} {dim} root {root}")
    c.done()


# ------------------------------------------------------------- reducescatter

@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter(op):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    dtypes = REDUCE_DTYPES if op == "Sum" else INTS + [torch.float32, torch.float64]
    for dtype, dim in itertools.product(dtypes, DIMS):
        tensor = random_tensor([size * 4] * dim).to(dtype)
        out = hvd.reducescatter(tensor, op=getattr(hvd, op))
        tensor, out = as_float(tensor, out)
        expected = tensor[rank * 4:(rank + 1) * 4] * (size if op == "Sum" else 1)
        c.check(list(out.shape) == list(expected.shape), f"{dtype} {dim}: shape")
        c.check((out - expected).max() <= threshold(size, dtype), f"{op} {dtype} {dim}")
    c.done()


@pytest.mark.parametrize("which", ["prescale", "postscale"])
def test_reducescatter_prescale_postscale(which):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    np.random.seed(12345)
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        factor = np.random.uniform()
        tensor = random_tensor([size * 4] * dim).to(dtype)
        out = hvd.reducescatter(tensor, op=hvd.Sum, **{which + "_factor": factor})
        math_dtype = (torch.float32 if dtype == torch.float16 else
                      torch.float64 if dtype in INTS else dtype)
        f = torch.tensor(factor, dtype=torch.float64).to(math_dtype)
        t = tensor.to(math_dtype)
        expected = (f * t).to(dtype) if which == "prescale" else ((size * t) * f).to(dtype)
        expected, out = as_float(expected, out)
        expected = expected[rank * 4:(rank + 1) * 4]
        if which == "prescale":
            expected = expected * size
            if dtype == torch.float16:  # the float16 sum is rounded once (see allreduce)
                expected = expected.half().float()
        c.check(list(out.shape) == list(expected.shape), f"{dtype} {dim}: shape")
        c.check((out - expected).max() <= threshold(size, dtype), f"{which} {dtype} {dim}")
    c.done()


def test_reducescatter_uneven_rows():
    """dim 0 not a multiple of the size: the first n % size ranks get one row more."""
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    rows = 2 * size + 1
    out = hvd.reducescatter(torch.arange(rows * 3, dtype=torch.float64).view(rows, 3),
                            op=hvd.Sum)
    first = sum(rows // size + (r < rows % size) for r in range(rank))
    n = rows // size + (rank < rows % size)
    expected = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3)[first:first + n] * size
    c.check(torch.equal(out, expected), f"{out} vs {expected}")
    c.done()


def test_reducescatter_errors():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    scalar = torch.tensor(float(rank))
    c.raises((RuntimeError, ValueError), lambda: hvd.reducescatter(scalar, op=hvd.Average),
             "0-d tensor")
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = random_tensor([size * 4] * dim).to(dtype)
        c.raises(RuntimeError, lambda: hvd.reducescatter(tensor, op=hvd.Adasum), "Adasum")
    if size > 1:
        tensor = random_tensor([17 + rank] * 3)
        c.raises(RuntimeError, lambda: hvd.reducescatter(tensor, name="reducescatter_error1"),
                 "different dimension")
        dims = [17, 23 * 57] if rank == 0 else [17, 23, 57]
        c.raises(RuntimeError, lambda: hvd.reducescatter(torch.ones(*dims)), "different rank")
        tensor = torch.IntTensor(17, 17, 17) if rank % 2 == 0 else torch.FloatTensor(17, 17, 17)
        c.raises(RuntimeError, lambda: hvd.reducescatter(tensor), "different type")
    c.done()


def test_reducescatter_async_fused():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    tests = []
    for i, (dtype, dim) in enumerate(itertools.product(REDUCE_DTYPES, DIMS)):
        tensor = random_tensor([size * 4] * dim).to(dtype)
        submit = lambda t=tensor: hvd.reducescatter_async(t, op=hvd.Sum)  # noqa: E731
        handle = c.submitted_pending(submit) if i == 0 else submit()
        tests.append((dtype, as_float(tensor)[0][rank * 4:(rank + 1) * 4] * size, handle))
    for dtype, expected, handle in tests:
        out, = as_float(hvd.synchronize(handle))
        c.check(list(out.shape) == list(expected.shape) and
                (out - expected).max() <= threshold(size, dtype), f"{dtype}")
    c.done()


@pytest.mark.parametrize("op,scale", [("Sum", "size"), ("Average", 1)])
def test_reducescatter_grad(op, scale):
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64, torch.float16], DIMS):
        tensor = random_tensor([size * 4] * dim).to(dtype).requires_grad_()
        out = hvd.reducescatter(tensor, op=getattr(hvd, op))
        out.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=dtype))
        c.grad_close(tensor.grad, np.ones([size * 4] * dim) * (size if scale == "size" else 1),
                     f"{dtype} {dim}")
    c.done()


def test_reducescatter_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    me = ranks.index(rank)
    n = len(ranks)
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        torch.manual_seed(1234)
        even = torch.FloatTensor(*([n * 4] * dim)).random_(-100, 100)
        odd = torch.FloatTensor(*([n * 4] * dim)).random_(-100, 100)
        tensor = (even if rank % 2 == 0 else odd).to(dtype)
        out = hvd.reducescatter(tensor, op=hvd.Sum, process_set=this_set)
        tensor, out = as_float(tensor, out)
        expected = tensor[me * 4:(me + 1) * 4] * n
        c.check((out - expected).max() <= threshold(n, dtype), f"{dtype} {dim}")
    remove_sets(sets)
    c.done()


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_grouped_reducescatter(op):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(INTS + FLOATS, DIMS):
        torch.manual_seed(1234)
        tensors = [torch.FloatTensor(*([size * 4] * dim)).random_(-100, 100).to(dtype)
                   for _ in range(5)]
        outs = hvd.grouped_reducescatter(tensors, op=getattr(hvd, op))
        for t, o in zip(tensors, outs):
            t, o = as_float(t, o)
            e = t[rank * 4:(rank + 1) * 4] * (size if op == "Sum" else 1)
            c.check(torch.allclose(e, o, threshold(size, dtype)), f"{op} {dtype} {dim}")
    c.done()


def test_grouped_reducescatter_grad():
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64, torch.float16], DIMS):
        torch.manual_seed(1234)
        tensors = [torch.FloatTensor(*([size * 4] * dim)).random_(-100, 100).to(dtype)
                   .requires_grad_() for _ in range(5)]
        for s in hvd.grouped_reducescatter(tensors, op=hvd.Sum):
            s.backward(torch.ones([4] + [size * 4] * (dim - 1), dtype=dtype))
        for t in tensors:
            c.grad_close(t.grad, np.ones([size * 4] * dim) * size, f"{dtype} {dim}")
    c.done()


# ------------------------------------------------------------------- barrier

def test_barrier_with_multiple_collectives():
    c = Checks()
    bcast = hvd.broadcast_async(torch.eye(3), root_rank=0)
    gather1 = hvd.allgather_async(torch.eye(5))
    gather2 = hvd.allgather_async(torch.zeros([5, 5]))
    reduce = hvd.allreduce_async(torch.eye(5))
    hvd.barrier()
    c.check(torch.equal(hvd.synchronize(reduce), torch.eye(5)), "allreduce after barrier")
    for h in (bcast, gather1, gather2):
        hvd.synchronize(h)
    c.done()
