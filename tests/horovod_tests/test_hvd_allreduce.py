"""hvd.allreduce and friends: the numerical assertions of Horovod's
test_torch.py (allreduce, average, min, max, product, in place, async fused,
prescale, postscale, process sets, errors, gradients, grouped), on the CPU."""
import itertools

import numpy as np
import pytest
from hvdtest import (
    DIMS,
    FLOATS,
    INTS,
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

# average= is Horovod's deprecated spelling, which its tests (and these) still use
pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_allreduce_sum():
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = random_tensor([17] * dim).to(dtype)
        summed = hvd.allreduce(tensor, average=False)
        tensor, summed = as_float(tensor, summed)
        c.check(summed.dtype == tensor.dtype, f"{dtype}: result dtype {summed.dtype}")
        c.check(torch.allclose(summed, tensor * size, threshold(size, dtype)), f"{dtype} {dim}")
    c.done()


def test_allreduce_average():
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product(INTS + [torch.float32, torch.float64], DIMS):
        tensor = random_tensor([17] * dim).to(dtype)
        averaged = hvd.allreduce(tensor, average=True)
        c.check(torch.allclose(averaged, tensor, threshold(size, dtype)), f"{dtype} {dim}")
        default = hvd.allreduce(tensor)  # Average is Horovod's default op
        c.check(torch.equal(default, averaged), f"{dtype} {dim}: default op is not Average")
    c.done()


@pytest.mark.parametrize("op,reference", [("Min", lambda t: t.min(0).values),
                                          ("Max", lambda t: t.max(0).values),
                                          ("Product", lambda t: t.prod(0))])
def test_allreduce_min_max_product(op, reference):
    c, size, rank = Checks(), hvd.size(), hvd.rank()
    for dtype, dim in itertools.product(INTS + [torch.float32, torch.float64], DIMS):
        torch.manual_seed(1234)
        tensors = torch.FloatTensor(size, *([17] * dim)).random_(-100, 100).to(dtype)
        result = hvd.allreduce(tensors[rank, ...], op=getattr(hvd, op))
        expected = reference(tensors).to(dtype)
        if op == "Product":
            c.check(torch.allclose(result, expected, threshold(size, dtype)), f"{dtype} {dim}")
        else:
            c.check(torch.equal(result, expected), f"{op} {dtype} {dim}")
    c.done()


def test_allreduce_inplace():
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        tensor = random_tensor([17] * dim)
        multiplied = (tensor * size).to(dtype)
        tensor = tensor.to(dtype)
        out = hvd.allreduce_(tensor, average=False)
        c.check(out is tensor, "allreduce_ returns its argument")
        tensor, multiplied = as_float(tensor, multiplied)
        c.check(torch.allclose(tensor, multiplied, threshold(size, dtype)), f"{dtype} {dim}")
    c.done()


def test_allreduce_async_fused():
    c, size = Checks(), hvd.size()
    tests = []
    for i, (dtype, dim) in enumerate(itertools.product(REDUCE_DTYPES, DIMS)):
        tensor = random_tensor([17] * dim).to(dtype)
        submit = lambda t=tensor: hvd.allreduce_async(t, average=False)  # noqa: E731
        handle = c.submitted_pending(submit) if i == 0 else submit()
        tests.append((dtype, as_float(tensor)[0] * size, handle))
    for dtype, multiplied, handle in tests:
        summed, = as_float(hvd.synchronize(handle))
        c.check(torch.allclose(summed, multiplied, threshold(size, dtype)), f"{dtype}")
        c.check(hvd.poll(handle) and hvd.synchronize(handle) is None,
                "a synchronized handle is finished and forgotten")
    c.done()


@pytest.mark.parametrize("which", ["prescale", "postscale"])
def test_allreduce_prescale_postscale(which):
    """Horovod's arithmetic: integers scaled in float64 and truncated,
    float16 in float32, float32 in float32, float64 in float64."""
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        np.random.seed(1234)
        factor = np.random.uniform()
        tensor = random_tensor([17] * dim).to(dtype)
        summed = hvd.allreduce(tensor, average=False, **{which + "_factor": factor})
        math_dtype = (torch.float32 if dtype == torch.float16 else
                      torch.float64 if dtype in INTS else dtype)
        f = torch.tensor(factor, dtype=torch.float64).to(math_dtype)
        t = tensor.to(math_dtype)
        if which == "prescale":
            expected = (f * t).to(dtype)
            summed, expected = as_float(summed, expected)
            expected = expected * size
            if dtype == torch.float16:
                # Horovod's test compares with the float32 product, which a
                # float16 sum holds only when it is representable (2 or 4
                # ranks): the sum is rounded to float16 once
                expected = expected.half().float()
        else:
            expected = ((size * t) * f).to(dtype)
            summed, expected = as_float(summed, expected)
        c.check(torch.allclose(summed, expected, threshold(size, dtype)), f"{dtype} {dim}")
    c.done()


def test_allreduce_average_with_scales_integers_truncate():
    """Average of integers: the sum times postscale/size in float64,
    truncated toward zero (Horovod's ScaleBuffer), checked against float64."""
    c, size, rank = Checks(), hvd.size(), hvd.rank()
    values = torch.tensor([-7, -1, 0, 1, 5, 100], dtype=torch.int64) + rank
    got = hvd.allreduce(values, op=hvd.Average, postscale_factor=0.7)
    total = sum((torch.tensor([-7, -1, 0, 1, 5, 100], dtype=torch.float64) + r)
                for r in range(size))
    c.check(torch.equal(got, (total * (0.7 / size)).trunc().to(torch.int64)), got.tolist())
    c.done()


def test_allreduce_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        torch.manual_seed(1234)
        even_tensor = torch.FloatTensor(*([17] * dim)).random_(-100, 100)
        odd_tensor = torch.FloatTensor(*([17] * dim)).random_(-100, 100)
        tensor = (even_tensor if rank % 2 == 0 else odd_tensor).to(dtype)
        summed = hvd.allreduce(tensor, average=False, process_set=this_set)
        tensor, summed = as_float(tensor, summed)
        c.check(torch.allclose(summed, tensor * len(ranks), threshold(len(ranks), dtype)),
                f"{dtype} {dim}")
    remove_sets(sets)
    c.done()


@pytest.mark.skipif(hvd.size() == 1, reason="needs two ranks")
def test_allreduce_errors():
    c, rank = Checks(), hvd.rank()
    tensor = random_tensor([17 + rank] * 3)
    c.raises(RuntimeError, lambda: hvd.allreduce(tensor), "different dimension")
    dims = [17, 23 * 57] if rank == 0 else [17, 23, 57]
    c.raises(RuntimeError, lambda: hvd.allreduce(torch.FloatTensor(*dims).random_(-100, 100)),
             "same count, different rank")
    tensor = torch.IntTensor(17, 17, 17) if rank % 2 == 0 else torch.FloatTensor(17, 17, 17)
    c.raises(RuntimeError, lambda: hvd.allreduce(tensor), "different type")
    # and the process group still works
    c.check(torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), hvd.size())),
            "allreduce after the errors")
    c.done()


def test_allreduce_duplicate_name_error():
    """A second pending operation of the same name is refused on the rank
    that submits it (Horovod's ValueError); every rank does the same here."""
    c = Checks()
    tensor = torch.ones(17, 17)
    h = hvd.allreduce_async(tensor, name="duplicate_name")
    c.raises(ValueError, lambda: hvd.allreduce_async(tensor, name="duplicate_name"),
             "duplicate name")
    c.check(torch.equal(hvd.synchronize(h), tensor), "the first one completes")
    h = hvd.allreduce_async(tensor, name="duplicate_name")  # free again
    hvd.synchronize(h)
    c.done()


@pytest.mark.parametrize("average,scale", [(False, "size"), (True, 1)])
def test_allreduce_grad(average, scale):
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = random_tensor([17] * dim).to(dtype).requires_grad_()
        summed = hvd.allreduce(tensor, average=average)
        summed.backward(torch.ones([17] * dim, dtype=dtype))
        expected = np.ones([17] * dim) * (size if scale == "size" else 1)
        c.grad_close(tensor.grad, expected, f"{dtype} {dim}")
    c.done()


def test_allreduce_grad_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        tensor = random_tensor([17] * dim, seed=1234 + rank % 2).to(dtype).requires_grad_()
        summed = hvd.allreduce(tensor, average=False, process_set=this_set)
        summed.backward(torch.ones([17] * dim, dtype=dtype))
        c.grad_close(tensor.grad, np.ones([17] * dim) * len(ranks), f"{dtype} {dim}")
    remove_sets(sets)
    c.done()


@pytest.mark.parametrize("mode", ["sum", "average", "inplace"])
def test_grouped_allreduce(mode):
    c, size = Checks(), hvd.size()
    dtypes = REDUCE_DTYPES if mode != "average" else INTS + FLOATS
    for dtype, dim in itertools.product(dtypes, DIMS):
        torch.manual_seed(1234)
        tensors = [torch.FloatTensor(*([17] * dim)).random_(-100, 100) for _ in range(5)]
        if mode == "inplace":
            expected = [(t * size).to(dtype) for t in tensors]
            tensors = [t.to(dtype) for t in tensors]
            hvd.grouped_allreduce_(tensors, average=False)
            got = tensors
        else:
            tensors = [t.to(dtype) for t in tensors]
            got = hvd.grouped_allreduce(tensors, average=mode == "average")
            expected = [t * size if mode == "sum" else t for t in tensors]
        for g, e in zip(got, expected):
            g, e = as_float(g, e)
            c.check(torch.allclose(g, e, threshold(size, dtype)), f"{mode} {dtype} {dim}")
    c.done()


def test_grouped_allreduce_process_sets():
    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        torch.manual_seed(1234)
        even = [torch.FloatTensor(*([17] * dim)).random_(-100, 100) for _ in range(5)]
        odd = [torch.FloatTensor(*([17] * dim)).random_(-100, 100) for _ in range(5)]
        tensors = [t.to(dtype) for t in (even if rank % 2 == 0 else odd)]
        summed = hvd.grouped_allreduce(tensors, average=False, process_set=this_set)
        for t, s in zip(tensors, summed):
            t, s = as_float(t, s)
            c.check(torch.allclose(s, t * len(ranks), threshold(len(ranks), dtype)),
                    f"{dtype} {dim}")
    remove_sets(sets)
    c.done()


@pytest.mark.parametrize("average", [False, True])
def test_grouped_allreduce_grad(average):
    c, size = Checks(), hvd.size()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        torch.manual_seed(1234)
        tensors = [torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype).requires_grad_()
                   for _ in range(5)]
        summed = hvd.grouped_allreduce(tensors, average=average)
        for s in summed:
            s.backward(torch.ones([17] * dim, dtype=dtype))
        for t in tensors:
            c.grad_close(t.grad, np.ones([17] * dim) * (1 if average else size), f"{dtype}")
    c.done()


def test_allreduce_compression_fp16():
    """hvd.allreduce(compression=fp16): float16 on the wire, the input's
    dtype back (exact here: small integers)."""
    c, size = Checks(), hvd.size()
    tensor = random_tensor([17, 17])
    out = hvd.allreduce(tensor, op=hvd.Sum, compression=hvd.Compression.fp16)
    c.check(out.dtype == torch.float32 and torch.equal(out, tensor * size), "fp16 compression")
    c.done()


@pytest.mark.skipif(hvd.size() == 1, reason="needs two ranks")
def test_names_in_a_different_order_match_by_name():
    """Horovod matches operations by name, whatever order the ranks submit
    them in: rank 0 submits 'a' then 'b', the others 'b' then 'a' (same
    shapes and dtypes); each reduces with its namesake, and the ranks carry
    on in step."""
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    a, b = torch.full((6,), 1.0 + rank), torch.full((6,), 10.0 + rank)
    order = [("a", a), ("b", b)] if rank == 0 else [("b", b), ("a", a)]
    handles = [(name, hvd.allreduce_async_(t, name=name, op=hvd.Sum)) for name, t in order]
    for _name, h in handles:
        hvd.synchronize(h)
    ranks = torch.arange(size, dtype=torch.float32)
    c.check(torch.equal(a, torch.full((6,), float((1.0 + ranks).sum()))), f"a: {a}")
    c.check(torch.equal(b, torch.full((6,), float((10.0 + ranks).sum()))), f"b: {b}")
    c.check(torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), size)),
            "allreduce afterwards")
    c.done()
