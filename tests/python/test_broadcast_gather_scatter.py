"""broadcast_, broadcast, allgather and reduce_scatter against NumPy references
built from every rank's locally regenerated inputs."""

import numpy as np
import pytest

from gsutil import (
    BF16,
    bits,
    check_result,
    check_unchanged,
    collectively,
    dtype_name,
    reduce_reference,
    reduce_tolerance,
)

pytestmark = pytest.mark.mpi

BIG = 5003  # elements: over the 4 KiB test threshold for every dtype

ALL = [np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8,
                             np.uint8, np.int32, np.int64)] + [BF16]


def check_bits(got, expected, what):
    assert isinstance(got, np.ndarray), "%s: not an ndarray: %r" % (
        what, type(got))
    assert got.dtype == expected.dtype, "%s: dtype %s, expected %s" % (
        what, got.dtype, expected.dtype)
    assert got.shape == expected.shape, "%s: shape %s, expected %s" % (
        what, got.shape, expected.shape)
    assert np.array_equal(bits(got), bits(expected)), (
        "%s: values differ from the expected bytes" % what)


# ------------------------------------------------------------------ broadcast

@pytest.mark.parametrize("which", ["default", "small_threshold"])
def test_broadcast_every_root_mixed_list(which, comm, small_comm, inputs):
    c = small_comm if which == "small_threshold" else comm
    shapes = [(0,), (1,), (17,), (3, 5), (BIG,), (2, 0), (129,), (1,),
              (2047,), (64,)]
    dtypes = [ALL[i % len(ALL)] for i in range(len(shapes))]
    for root in range(c.size):
        per_rank = inputs.all_ranks(shapes, dtypes, "bits", tag=root)
        mine = [a.copy() for a in per_rank[c.rank]]
        with collectively(what="root %d" % root) as blk:
            out = c.broadcast_(mine, root=root)
            assert isinstance(out, list) and len(out) == len(mine)
            for i in range(len(shapes)):
                assert out[i] is mine[i], "broadcast_ must return its inputs"
                check_bits(mine[i], per_rank[root][i],
                           "root %d tensor %d" % (root, i))
            blk.same(mine)


@pytest.mark.parametrize("dtype", ALL, ids=dtype_name)
def test_broadcast_single_array(dtype, comm, inputs):
    for root in range(comm.size):
        per_rank = inputs.all_ranks([(7, 3)], dtype, "bits", tag=root)
        x = per_rank[comm.rank][0].copy()
        with collectively(what="root %d" % root):
            out = comm.broadcast_(x, root)
            assert out is x, "one array in must return that array"
            check_bits(x, per_rank[root][0], "root %d" % root)


def test_broadcast_many_tensors_over_threshold(small_comm, inputs):
    c = small_comm
    rng = inputs.rng(None, "shapes")
    shapes = [(int(n),) for n in rng.integers(0, 1500, 60)]
    shapes[10] = (3 * BIG,)
    dtypes = [ALL[i % len(ALL)] for i in range(len(shapes))]
    root = c.size - 1
    per_rank = inputs.all_ranks(shapes, dtypes, "bits")
    mine = [a.copy() for a in per_rank[c.rank]]
    with collectively():
        c.broadcast_(mine, root=root)
        for i in range(len(shapes)):
            check_bits(mine[i], per_rank[root][i], "tensor %d" % i)


@pytest.mark.parametrize("which", ["default", "small_threshold"])
def test_broadcast_views(which, comm, small_comm, inputs):
    """Tensors back to back in one allocation (zero-copy path), with gaps, in
    reverse memory order, and with foreign empty arrays: all take root's
    values and nothing outside them is written."""
    c = small_comm if which == "small_threshold" else comm
    dt = np.dtype(np.float32)
    shapes = [(0,), (31,), (1,), (4, 7), (BIG,), (2,), (0, 3), (129,)]
    counts = [int(np.prod(s)) for s in shapes]
    root = c.size - 1
    per_rank = inputs.all_ranks(shapes, dt, "bits")
    for name, gap, reverse, foreign in (("packed", 0, False, False),
                                        ("gapped", 3, False, False),
                                        ("reversed", 0, True, False),
                                        ("foreign_empty", 0, False, True)):
        total = sum(counts) + gap * len(counts)
        buf = np.full(total + 32, 7.0, dtype=dt)
        order = list(range(len(shapes)))[::-1] if reverse else range(
            len(shapes))
        views, mask, off = [None] * len(shapes), np.ones(buf.size, bool), 16
        for i in order:
            views[i] = buf[off:off + counts[i]].reshape(shapes[i])
            mask[off:off + counts[i]] = False
            off += counts[i] + gap
        if foreign:
            views = [np.empty(s, dt) if n == 0 else v
                     for v, s, n in zip(views, shapes, counts)]
        for v, a in zip(views, per_rank[c.rank]):
            v[...] = a
        with collectively(what=name) as blk:
            out = c.broadcast_(views, root=root)
            for i in range(len(shapes)):
                assert out[i] is views[i]
                check_bits(views[i], per_rank[root][i],
                           "%s tensor %d" % (name, i))
            assert np.all(buf[mask] == 7.0), (
                "%s: memory outside the tensors was written" % name)
            blk.same(views)


def test_broadcast_out_of_place(comm, inputs):
    shapes = [(5,), (0,), (4, 4)]
    dtypes = [np.dtype(np.float32), np.dtype(np.int64), BF16]
    root = comm.size // 2
    per_rank = inputs.all_ranks(shapes, dtypes, "bits")
    mine = [a.copy() for a in per_rank[comm.rank]]
    with collectively():
        out = comm.broadcast(mine, root=root)
        assert isinstance(out, list) and len(out) == 3
        for i in range(3):
            assert out[i] is not mine[i]
            check_bits(out[i], per_rank[root][i], "tensor %d" % i)
        check_unchanged(mine, per_rank[comm.rank])


# ------------------------------------------------------------------ allgather

ROWS = [3, 0, 5, 1, 2]  # rank 1 contributes no rows


def rows_of(r, shift=0):
    return ROWS[(r + shift) % len(ROWS)]


@pytest.mark.parametrize("trail", [(), (3,), (2, 2)],
                         ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", ALL, ids=dtype_name)
def test_allgather_varying_rows(dtype, trail, comm, inputs):
    P = comm.size
    per_rank = [inputs.arrays(r, [(rows_of(r),) + trail], dtype, "bits")[0]
                for r in range(P)]
    x = per_rank[comm.rank].copy()
    expected = np.concatenate(per_rank, axis=0)
    with collectively() as blk:
        out = comm.allgather(x)
        assert isinstance(out, np.ndarray), "one array in -> one array out"
        check_bits(out, expected, "allgather")
        check_unchanged([x], [per_rank[comm.rank]])
        blk.same(out)


def test_allgather_all_ranks_empty(comm):
    x = np.zeros((0, 3), dtype=np.float32)
    with collectively():
        out = comm.allgather(x)
        assert out.shape == (0, 3) and out.dtype == np.float32


@pytest.mark.parametrize("which", ["default", "small_threshold"])
def test_allgather_list_each_on_its_own(which, comm, small_comm, inputs):
    c = small_comm if which == "small_threshold" else comm
    P = c.size
    specs = [  # (dtype, trailing shape, rows as a function of rank)
        (np.dtype(np.float32), (), lambda r: rows_of(r)),
        (np.dtype(np.int8), (5,), lambda r: rows_of(r, 2)),
        (np.dtype(np.float16), (), lambda r: 0),
        (BF16, (3,), lambda r: r + 1),
        (np.dtype(np.int64), (2, 2), lambda r: rows_of(r, 1)),
        (np.dtype(np.float64), (), lambda r: BIG if r == 0 else 7),
        (np.dtype(np.uint8), (), lambda r: BIG - r),
    ]
    per_rank = []
    for r in range(P):
        shapes = [(f(r),) + t for _, t, f in specs]
        per_rank.append(inputs.arrays(r, shapes, [d for d, _, _ in specs],
                                      "bits"))
    mine = [a.copy() for a in per_rank[c.rank]]
    with collectively() as blk:
        out = c.allgather(mine)
        assert isinstance(out, list) and len(out) == len(specs)
        for i in range(len(specs)):
            expected = np.concatenate([per_rank[r][i] for r in range(P)])
            check_bits(out[i], expected, "tensor %d" % i)
        check_unchanged(mine, per_rank[c.rank])
        blk.same(out)


# ------------------------------------------------------------ reduce_scatter

def block(n, size, r):
    base, rem = divmod(n, size)
    start = r * base + min(r, rem)
    return start, base + (r < rem)


def row_counts(size):
    # none divisible by size (for size > 1): 1, size - 1, size + 1, ...
    ns = {0, 1, 7, 13, size + 1, 2 * size + 3}
    if size > 1:
        ns.add(size - 1)
    return sorted(ns)


RS_CASES = [("sum", np.float32), ("sum", np.float16), ("sum", BF16),
            ("sum", np.float64), ("sum", np.int32), ("sum", np.int8),
            ("average", np.float32), ("average", np.float16),
            ("average", BF16), ("average", np.float64),
            ("max", np.float32), ("max", np.int64), ("max", np.uint8),
            ("max", BF16)]


@pytest.mark.parametrize("op,dtype", [(o, np.dtype(d)) for o, d in RS_CASES],
                         ids=["%s-%s" % (o, np.dtype(d).name)
                              for o, d in RS_CASES])
def test_reduce_scatter(op, dtype, comm, inputs):
    P, me = comm.size, comm.rank
    kind = "full" if op == "max" else "normal"
    ns = row_counts(P)
    shapes = [(n,) for n in ns] + [(n, 3) for n in ns]
    per_rank = inputs.all_ranks(shapes, dtype, kind)
    mine = [a.copy() for a in per_rank[me]]

    def expected(i):
        col = [per_rank[r][i] for r in range(P)]
        ref = reduce_reference(col, op)
        tol = reduce_tolerance(col, op)
        start, cnt = block(shapes[i][0], P, me)
        tol = tol if np.ndim(tol) == 0 else tol[start:start + cnt]
        return ref[start:start + cnt], tol, (cnt,) + shapes[i][1:]

    with collectively(what="list"):
        out = comm.reduce_scatter(mine, op)
        assert isinstance(out, list) and len(out) == len(shapes)
        for i in range(len(shapes)):
            ref, tol, shape = expected(i)
            check_result(out[i], ref, tol, dtype, shape,
                         what="tensor %d %s" % (i, shapes[i]))
        check_unchanged(mine, per_rank[me])
    with collectively(what="single"):
        i = len(shapes) - 2  # (2*size+3, 3) or (13, 3)
        one = comm.reduce_scatter(mine[i], op=op)
        assert isinstance(one, np.ndarray), "one array in -> one array out"
        ref, tol, shape = expected(i)
        check_result(one, ref, tol, dtype, shape, what="single")


def test_reduce_scatter_blocks_cover_reduction(comm, inputs):
    """Allgather of the blocks reassembles the full (exact) reduction,
    identical on every rank."""
    n = 2 * comm.size + 1
    per_rank = inputs.all_ranks([(n, 4)], np.int32)
    with collectively():
        part = comm.reduce_scatter(per_rank[comm.rank][0].copy(), "sum")
    with collectively() as blk:
        full = comm.allgather(part)
        ref = reduce_reference([p[0] for p in per_rank], "sum")
        check_result(full, ref, 0, np.int32, (n, 4), what="reassembled")
        blk.same(full)


def test_reduce_scatter_scales(comm, inputs):
    P, me = comm.size, comm.rank
    n = 3 * P + 2
    per_rank = inputs.all_ranks([(n, 2)], np.float32)
    col = [p[0] for p in per_rank]
    ref = reduce_reference(col, "sum", 0.5, 3.0)
    tol = reduce_tolerance(col, "sum", 0.5, 3.0)
    start, cnt = block(n, P, me)
    with collectively():
        out = comm.reduce_scatter(per_rank[me][0].copy(), "sum",
                                  prescale=0.5, postscale=3.0)
        check_result(out, ref[start:start + cnt], tol[start:start + cnt],
                     np.float32, (cnt, 2))


@pytest.mark.parametrize("dtype", [np.int32, np.uint8], ids=dtype_name)
def test_reduce_scatter_average_integer_raises(dtype, comm):
    x = np.arange(10, dtype=dtype)
    with collectively():
        with pytest.raises(TypeError):
            comm.reduce_scatter(x, "average")
        assert np.array_equal(x, np.arange(10, dtype=dtype))


def test_reduce_scatter_over_threshold(small_comm, inputs):
    c = small_comm
    P, me = c.size, c.rank
    shapes = [(3 * BIG + 1,), (7, 3), (BIG, 2)]
    dtypes = [np.dtype(np.float64), np.dtype(np.int8), np.dtype(np.float16)]
    per_rank = inputs.all_ranks(shapes, dtypes, "small")
    with collectively():
        out = c.reduce_scatter([a.copy() for a in per_rank[me]], "sum")
        for i, s in enumerate(shapes):
            ref = reduce_reference([per_rank[r][i] for r in range(P)], "sum")
            start, cnt = block(s[0], P, me)
            check_result(out[i], ref[start:start + cnt], 0, dtypes[i],
                         (cnt,) + s[1:], what="tensor %d" % i)
