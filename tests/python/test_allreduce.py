"""comm.allreduce / comm.allreduce_ against a float64 (int64) NumPy reference.

Each rank regenerates every rank's inputs locally (gsutil.Inputs), so the
reference needs no communication.  Results must also be bitwise identical on
all ranks.
"""

import numpy as np
import pytest

import gradsync as gs
from gsutil import (
    ALL_DTYPES,
    BF16,
    FLOAT_DTYPES,
    INT_DTYPES,
    OPS,
    bits,
    check_reduction,
    check_result,
    check_unchanged,
    collective_assert,
    collectively,
    dtype_name,
    finfo,
    is_int,
    reduce_reference,
    reduce_tolerance,
    ride_bytes,
)

pytestmark = pytest.mark.mpi

SMALL_THRESHOLD = 4096
BIG = 5003  # elements: larger than 4096 bytes even for int8

# Values for each op: sums that cannot overflow the integer dtypes, full
# ranges for min/max, power-of-two factors for prod (exact products).
KIND = {"sum": "normal", "average": "normal", "min": "full", "max": "full",
        "prod": "prod"}


def layout_shapes(layout, inputs):
    rng = inputs.rng(None, "shapes")
    if layout == "one":
        return [(13, 77)]  # 1001 elements, 2-D
    if layout == "tiny":
        # a few elements in all: small enough to travel with the validation
        # message (at most 112 bytes even for 8-byte dtypes)
        return [(0,), (1,), (3,), (2, 5)]
    if layout == "many":
        sizes = rng.integers(0, 64, size=200)
        sizes[[0, 57, 199]] = 0
        sizes[[1, 100]] = 1
        sizes[[2, 3]] = [7, 63]
        shapes = []
        for i, n in enumerate(sizes):
            n = int(n)
            if i % 5 == 4:
                shapes.append((n, 3))  # 2-D, dim 0 may be 0
            else:
                shapes.append((n,))
        return shapes
    if layout == "threshold":
        sizes = [int(n) for n in rng.integers(0, 300, size=14)]
        sizes[0] = 0
        sizes[3] = 1
        shapes = [(n,) for n in sizes]
        shapes.insert(5, (BIG,))            # one tensor over the threshold
        shapes.insert(9, (1031,))           # over it for 4-byte dtypes and up
        shapes.append((101, 5))             # 505 elements, 2-D
        return shapes
    raise ValueError(layout)


def _matrix():
    params = []
    for op in OPS:
        for dt in ALL_DTYPES:
            if op == "average" and is_int(dt):
                continue  # TypeError: tested separately
            params.append(pytest.param(op, dt, id="%s-%s" % (op, dt.name)))
    return params


@pytest.mark.parametrize("layout", ["one", "tiny", "many", "threshold"])
@pytest.mark.parametrize("op,dtype", _matrix())
def test_allreduce(op, dtype, layout, comm, small_comm, inputs):
    """Out of place, then in place, on the same inputs."""
    c = small_comm if layout == "threshold" else comm
    shapes = layout_shapes(layout, inputs)
    per_rank = inputs.all_ranks(shapes, dtype, KIND[op])
    cache = {}
    for inplace in (False, True):
        mine = [a.copy() for a in per_rank[c.rank]]
        copies = [a.copy() for a in mine]
        arg = mine[0] if layout == "one" else mine
        mode = "in place" if inplace else "out of place"
        with collectively(what=mode) as blk:
            out = c.allreduce_(arg, op) if inplace else c.allreduce(arg, op)
            if layout == "one":
                assert isinstance(out, np.ndarray), (
                    "one array in must give one array out, got %r" % type(out))
                outs = [out]
            else:
                assert isinstance(out, list), (
                    "list in must give list out, got %r" % type(out))
                assert len(out) == len(mine)
                outs = out
            check_reduction(outs, per_rank, op, shapes, dtype, cache=cache,
                            what=mode + " tensor")
            for i, o in enumerate(outs):
                if inplace:
                    assert o is mine[i], "in-place call must return its inputs"
                else:
                    assert o is not mine[i]
                    assert o.size == 0 or not np.shares_memory(o, mine[i]), (
                        "out-of-place result %d shares memory with its input"
                        % i)
            if not inplace:
                check_unchanged(mine, copies)
            blk.same(outs)


@pytest.mark.parametrize("inplace", [False, True],
                         ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("kwargs", [
    {"op": "average"},
    {"op": "sum", "prescale": 2.0},
    {"op": "sum", "postscale": 0.5},
    {"op": "average", "postscale": 2.0},
], ids=["average", "prescale", "postscale", "average_postscale"])
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=dtype_name)
def test_integer_scaling_raises_typeerror(dtype, kwargs, inplace, comm,
                                          inputs):
    x = inputs.arrays(comm.rank, [(5,), (3, 2)], dtype)
    copies = [a.copy() for a in x]
    fn = comm.allreduce_ if inplace else comm.allreduce
    with collectively():
        with pytest.raises(TypeError):
            fn(x, **kwargs)
        check_unchanged(x, copies)
    # the communicator still works afterwards
    with collectively():
        out = comm.allreduce(x, "max")
        assert len(out) == 2


SCALES = [
    ("sum", 0.5, 1.0),
    ("sum", 1.0, 0.25),
    ("sum", 3.0, 0.1),
    ("average", 1.0, 1.0),
    ("average", 1.0, 2.0),
    ("average", 0.5, 3.0),
    ("max", 2.0, 0.5),     # powers of two: exact
    ("min", -1.0, 1.0),    # min of negated inputs: exact
]


@pytest.mark.parametrize("op,prescale,postscale", SCALES,
                         ids=["%s-pre%g-post%g" % s for s in SCALES])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_prescale_postscale(dtype, op, prescale, postscale, comm, small_comm,
                            inputs):
    shapes = [(0,), (1,), (17,), (3, 5), (2053,)]  # 2053: > 4 KiB for float16
    per_rank = inputs.all_ranks(shapes, dtype)
    for inplace, c in ((False, comm), (True, small_comm)):
        mine = [a.copy() for a in per_rank[c.rank]]
        copies = [a.copy() for a in mine]
        with collectively() as blk:
            kw = dict(prescale=prescale, postscale=postscale)
            out = (c.allreduce_(mine, op, **kw) if inplace
                   else c.allreduce(mine, op, **kw))
            check_reduction(out, per_rank, op, shapes, dtype, prescale,
                            postscale, what="inplace=%s tensor" % inplace)
            if not inplace:
                check_unchanged(mine, copies)
            blk.same(out)


@pytest.mark.parametrize("n", [7, 257])
def test_average_is_sum_times_inverse_size(n, comm, inputs):
    """average == sum with postscale 1/size, one multiply: with inputs whose
    sum is exact, average(x) must equal float32(sum) * float32(1/size)."""
    shapes = [(n,)]
    per_rank = inputs.all_ranks(shapes, np.float32, "small")
    mine = [per_rank[comm.rank][0].copy()]
    with collectively() as blk:
        avg = comm.allreduce(mine, "average")[0]
        exact_sum = np.sum([p[0].astype(np.float64) for p in per_rank], axis=0)
        ref = (exact_sum.astype(np.float32) *
               np.float32(1.0 / comm.size)).astype(np.float32)
        assert np.array_equal(avg, ref), "average != sum * float32(1/size)"
        blk.same(avg)


MIXED = [(np.float32, (5,)), (np.int32, (7,)), (np.float16, (0,)),
         (np.float32, (3, 3)), (np.float64, (1,)), (BF16, (9,)),
         (np.int8, (4,)), (np.uint8, (6, 2)), (np.int64, (2,)),
         (np.float16, (33,)), (BF16, (1,)), (np.float64, (BIG,)),
         (np.int8, (BIG,)), (np.float32, (11,))]


@pytest.mark.parametrize("which", ["default", "small_threshold"])
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_mixed_dtype_list(op, which, comm, small_comm, inputs):
    c = small_comm if which == "small_threshold" else comm
    dtypes = [np.dtype(d) for d, _ in MIXED]
    shapes = [s for _, s in MIXED]
    per_rank = inputs.all_ranks(shapes, dtypes, KIND[op])
    for inplace in (False, True):
        mine = [a.copy() for a in per_rank[c.rank]]
        with collectively() as blk:
            out = c.allreduce_(mine, op) if inplace else c.allreduce(mine, op)
            assert isinstance(out, list) and len(out) == len(mine)
            for i, (dt, s) in enumerate(zip(dtypes, shapes)):
                col = [per_rank[r][i] for r in range(c.size)]
                check_result(out[i], reduce_reference(col, op),
                             reduce_tolerance(col, op), dt, s,
                             what="tensor %d (%s, inplace=%s)" % (
                                 i, dt.name, inplace))
                if inplace:
                    assert out[i] is mine[i]
            blk.same(out)


def _views(buf, offsets, shapes):
    out = []
    for off, s in zip(offsets, shapes):
        n = int(np.prod(s, dtype=np.int64))
        out.append(buf[off:off + n].reshape(s))
    return out


@pytest.mark.parametrize("which", ["default", "small_threshold"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16),
                                   np.dtype(np.int32), BF16],
                         ids=dtype_name)
def test_back_to_back_views_match_separate_arrays(dtype, which, comm,
                                                  small_comm, inputs):
    """The zero-copy path (tensors that sit back to back in one allocation)
    gives the same result as the same tensors scattered in memory, and writes
    nothing outside the tensors. Values are small integers so every sum is
    exact and the comparison can be exact too."""
    c = small_comm if which == "small_threshold" else comm
    shapes = [(0,), (31,), (1,), (4, 7), (BIG,), (2,), (0, 3), (129,)]
    counts = [int(np.prod(s)) for s in shapes]
    per_rank = inputs.all_ranks(shapes, dtype, "small")
    mine = per_rank[c.rank]
    guard = 16
    total = sum(counts)

    # back to back, with guard elements before and after
    buf = np.full(total + 2 * guard, 77, dtype=dtype)
    offs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) + guard
    packed = _views(buf, offs, shapes)
    for v, a in zip(packed, mine):
        v[...] = a
    # the same tensors with a gap of 3 elements between neighbours
    gbuf = np.full(total + 3 * len(shapes) + guard, 55, dtype=dtype)
    goffs = [int(o) - guard + 3 * i for i, o in enumerate(offs)]
    gapped = _views(gbuf, goffs, shapes)
    for v, a in zip(gapped, mine):
        v[...] = a
    gmask = np.ones(gbuf.size, dtype=bool)
    for o, n in zip(goffs, counts):
        gmask[o:o + n] = False
    # back to back in memory, but listed in reverse order
    rbuf = np.empty(total, dtype=dtype)
    roffs = np.concatenate([[0], np.cumsum(counts[::-1])[:-1]]).astype(int)
    rev = _views(rbuf, roffs, shapes[::-1])[::-1]
    for v, a in zip(rev, mine):
        v[...] = a
    refs = []
    for i in range(len(shapes)):
        col = [per_rank[r][i] for r in range(c.size)]
        refs.append(reduce_reference(col, "sum"))

    for name, views in (("packed", packed), ("gapped", gapped),
                        ("reversed", rev)):
        with collectively(what=name) as blk:
            out = c.allreduce_(views, "sum")
            for i, s in enumerate(shapes):
                assert out[i] is views[i]
                check_result(out[i], refs[i], 0.0, dtype, s,
                             what="%s tensor %d" % (name, i))
            blk.same(out)
    with collectively():
        assert np.all(buf[:guard] == 77) and np.all(buf[-guard:] == 77), (
            "guard elements around the packed tensors were written")
        assert np.all(gbuf[gmask] == 55), "gaps between tensors were written"
        for a, b, r in zip(packed, gapped, rev):
            assert np.array_equal(bits(a), bits(b))
            assert np.array_equal(bits(a), bits(r))

    # out of place on the packed views: same values, inputs untouched
    packed2 = _views(buf, offs, shapes)
    before = buf.copy()
    with collectively():
        out = c.allreduce(packed2, "sum")
        assert np.array_equal(bits(buf), bits(before)), "input buffer changed"
        for i, s in enumerate(shapes):
            # the inputs now hold the reduction: summing again gives size * it
            expected = refs[i] * c.size
            check_result(out[i], expected, 0.0, dtype, s,
                         what="out-of-place packed %d" % i)


RIDE = ride_bytes()  # every rank imports this module, so all make the communicator


@pytest.mark.parametrize("dtype,n", [(np.float32, RIDE // 4), (np.float32, RIDE // 4 + 1),
                                     (np.int8, RIDE), (np.int8, RIDE + 1),
                                     (np.float64, RIDE // 8 - 1), (np.float64, RIDE // 8 + 1)],
                         ids=["float32-at", "float32-over", "int8-at",
                              "int8-over", "float64-under", "float64-over"])
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_payload_size_boundaries(op, dtype, n, comm, inputs):
    """Around check_payload_bytes, where a small call can travel with the validation
    message; one tensor and the same bytes split over two tensors."""
    for shapes in ([(n,)], [(n // 2,), (n - n // 2,)]):
        per_rank = inputs.all_ranks(shapes, dtype, KIND[op], tag=len(shapes))
        for inplace in (False, True):
            mine = [a.copy() for a in per_rank[comm.rank]]
            with collectively(what="%d tensors inplace=%s" % (
                    len(shapes), inplace)) as blk:
                out = (comm.allreduce_(mine, op) if inplace
                       else comm.allreduce(mine, op))
                check_reduction(out, per_rank, op, shapes, dtype)
                if not inplace:
                    check_unchanged(mine, per_rank[comm.rank])
                blk.same(out)


def test_large_single_tensor_over_threshold(small_comm, inputs):
    """A single tensor much larger than the fusion threshold, both modes."""
    c = small_comm
    shapes = [(40009,)]
    per_rank = inputs.all_ranks(shapes, np.float32)
    col = [p[0] for p in per_rank]
    ref, tol = reduce_reference(col, "sum"), reduce_tolerance(col, "sum")
    x = per_rank[c.rank][0].copy()
    with collectively() as blk:
        out = c.allreduce(x, "sum")
        check_result(out, ref, tol, np.float32, shapes[0])
        assert np.array_equal(x, per_rank[c.rank][0])
        blk.same(out)
    with collectively():
        res = c.allreduce_(x, "sum")
        assert res is x
        assert np.array_equal(bits(res), bits(out)), (
            "in-place and out-of-place results differ for the same input")


def test_deterministic_run_after_run(comm, small_comm, inputs):
    """Same inputs, same ranks: bitwise identical results every time."""
    shapes = [(int(n),) for n in inputs.rng(None).integers(0, 700, 40)]
    dtypes = [FLOAT_DTYPES[i % 4] for i in range(len(shapes))]
    per_rank = inputs.all_ranks(shapes, dtypes)
    results = []
    for c in (comm, comm, small_comm, small_comm):
        with collectively():
            out = c.allreduce([a.copy() for a in per_rank[c.rank]], "sum")
        results.append(out)
    with collectively():
        for k in (1, 3):
            for a, b in zip(results[k - 1], results[k]):
                assert np.array_equal(bits(a), bits(b)), (
                    "repeated allreduce gave different bits")


def test_empty_list_and_zero_dim(comm, inputs):
    with collectively():
        assert comm.allreduce([]) == []
    with collectively():
        assert comm.allreduce_([]) == []
    x = np.array(1.5 + comm.rank, dtype=np.float64)
    with collectively():
        out = comm.allreduce(x, "sum")
        assert isinstance(out, np.ndarray) and out.shape == ()
        assert out.dtype == np.float64
        assert out == sum(1.5 + r for r in range(comm.size))
    y = np.array(comm.rank, dtype=np.int32)
    with collectively():
        res = comm.allreduce_(y, "max")
        assert res is y and int(y) == comm.size - 1


def test_ops_as_enum_and_string(comm, inputs):
    shapes = [(9,), (4, 4)]
    per_rank = inputs.all_ranks(shapes, np.int32, "prod")
    mine = per_rank[comm.rank]
    for name, enum in (("sum", gs.Op.SUM), ("min", gs.Op.MIN),
                       ("max", gs.Op.MAX), ("prod", gs.Op.PROD)):
        with collectively(what=name):
            a = comm.allreduce(mine, name)
            b = comm.allreduce(mine, op=enum)
            for i, s in enumerate(shapes):
                col = [per_rank[r][i] for r in range(comm.size)]
                ref = reduce_reference(col, name)
                check_result(a[i], ref, 0, np.int32, s, what=name)
                check_result(b[i], ref, 0, np.int32, s, what=repr(enum))
    f = [a.astype(np.float64) for a in mine]
    with collectively():
        a = comm.allreduce(f, "average")
        b = comm.allreduce(f, gs.Op.AVERAGE)
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


class HostDLPack:
    """A non-NumPy host tensor that only speaks DLPack."""

    def __init__(self, array):
        self._a = array

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_host_dlpack_objects(comm, inputs):
    shapes = [(10,), (0,), (3, 4)]
    per_rank = inputs.all_ranks(shapes, np.float32, "small")
    backing = [a.copy() for a in per_rank[comm.rank]]
    objs = [HostDLPack(a) for a in backing]
    refs = [reduce_reference([per_rank[r][i] for r in range(comm.size)],
                             "sum") for i in range(len(shapes))]
    with collectively():
        out = comm.allreduce(objs, "sum")
        for i, s in enumerate(shapes):
            check_result(out[i], refs[i], 0.0, np.float32, s,
                         what="out-of-place dlpack %d" % i)
            assert np.array_equal(backing[i], per_rank[comm.rank][i])
    with collectively():
        res = comm.allreduce_(objs, "sum")
        for i, s in enumerate(shapes):
            assert res[i] is objs[i]
            check_result(backing[i], refs[i], 0.0, np.float32, s,
                         what="in-place dlpack %d" % i)


def test_bfloat16_is_ml_dtypes():
    import ml_dtypes
    collective_assert(np.dtype(gs.bfloat16) == np.dtype(ml_dtypes.bfloat16),
                      "gs.bfloat16 is %r" % (gs.bfloat16,))


def _tie_cases(dtype):
    """(a, b) pairs whose sum needs rounding: halfway cases that round to
    even (down and up), subnormals, signed zeros and cancellation."""
    fi = finfo(dtype)
    m = int(fi.nmant)           # explicit mantissa bits
    ulp1 = 2.0 ** -m            # ulp of 1.0
    sub = float(fi.tiny) * float(fi.eps)  # smallest subnormal
    pairs = [
        (1.0, ulp1 / 2),                 # tie, 1.0 is even: stays 1.0
        (1.0 + ulp1, ulp1 / 2),          # tie, rounds up to the even 1+2ulp
        (-1.0 - ulp1, -ulp1 / 2),        # same, negative
        (1.0, ulp1 / 4),                 # below half: 1.0
        (1.0, 3 * ulp1 / 4),             # above half: 1 + ulp
        (3.0, 3.0),
        (sub, sub),                      # subnormals must not flush to zero
        (3 * sub, -sub),
        (float(fi.tiny), -sub),          # normal minus subnormal
        (0.0, -0.0),
        (5.5, -5.5),
        (float(fi.max) / 2, float(fi.max) / 4),
    ]
    return pairs


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_sum_rounds_to_nearest_even(dtype, comm, inputs):
    """Ranks 0 and 1 contribute a and b, the others zeros: whatever the
    reduction order, the only inexact step is a + b, so the result must be
    exactly a + b rounded once to nearest even (for float16/bfloat16: the
    float32 sum -- exact here -- rounded once to the dtype)."""
    dtype = np.dtype(dtype)
    pairs = _tie_cases(dtype)
    rng = inputs.rng(None)
    rand = [(float(x), float(y)) for x, y in
            (rng.standard_normal((500, 2)) * 4)]
    a = np.array([p[0] for p in pairs] + [p[0] for p in rand]).astype(dtype)
    b = np.array([p[1] for p in pairs] + [p[1] for p in rand]).astype(dtype)
    mine = {0: a, 1: b}.get(comm.rank, np.zeros_like(a))
    acc = np.float64 if dtype == np.float64 else np.float32
    if dtype == np.float64:
        expected = a + b
    else:
        expected = (a.astype(acc) + b.astype(acc)).astype(dtype)
    for inplace in (False, True):
        x = mine.copy()
        with collectively(what="inplace=%s" % inplace) as blk:
            out = comm.allreduce_(x, "sum") if inplace else comm.allreduce(
                x, "sum")
            bad = ~(out.astype(np.float64) == expected.astype(np.float64))
            assert not bad.any(), "not rounded to nearest even: %s" % [
                (a[i].item(), b[i].item(), out[i].item(), expected[i].item())
                for i in np.flatnonzero(bad)[:6]]
            blk.same(out)


@pytest.mark.parametrize("which", ["default", "small_threshold"])
def test_views_of_one_byte_buffer_mixed_dtypes(which, comm, small_comm,
                                               inputs):
    """float32 / int32 / float16 views carved from one uint8 buffer, listed
    so that each dtype group is back to back in memory but the list is not,
    with empty arrays from elsewhere in between; bytes outside the views stay
    untouched."""
    c = small_comm if which == "small_threshold" else comm
    f32, i32, f16 = (np.dtype(np.float32), np.dtype(np.int32),
                     np.dtype(np.float16))
    # (dtype, elements) in memory order
    layout = [(f32, 10), (f32, 1200), (i32, 7), (f16, 3), (f16, 2100),
              (i32, 1100), (f32, 5)]
    nbytes = sum(d.itemsize * n for d, n in layout) + 64
    buf = np.full(nbytes, 0xAB, dtype=np.uint8)
    views, off = [], 32
    for d, n in layout:
        views.append(buf[off:off + d.itemsize * n].view(d))
        off += d.itemsize * n
    untouched = np.ones(nbytes, dtype=bool)
    untouched[32:off] = False
    # list order: interleave the dtypes, plus foreign empty arrays
    order = [0, 2, 3, 1, 5, 4, 6]
    lst, dtypes, shapes = [], [], []
    for k, i in enumerate(order):
        lst.append(views[i])
        if k == 2:
            lst.append(np.empty(0, dtype=f32))
        if k == 4:
            lst.append(np.empty((0, 3), dtype=f16))
    dtypes = [a.dtype for a in lst]
    shapes = [a.shape for a in lst]
    per_rank = inputs.all_ranks(shapes, dtypes, "small")
    for a, v in zip(lst, per_rank[c.rank]):
        a[...] = v
    with collectively() as blk:
        out = c.allreduce_(lst, "sum")
        for i, (o, d, s) in enumerate(zip(out, dtypes, shapes)):
            assert o is lst[i]
            col = [per_rank[r][i] for r in range(c.size)]
            check_result(o, reduce_reference(col, "sum"), 0, d, s,
                         what="tensor %d" % i)
        assert np.all(buf[untouched] == 0xAB), "bytes outside the views changed"
        blk.same(out)
