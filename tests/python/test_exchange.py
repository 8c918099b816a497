"""alltoall (even and uneven splits), alltoall_counts, gather, scatter and
reduce against NumPy references built from every rank's locally regenerated
inputs (float64/int64 for reductions, the senders' bytes for data movement);
their asynchronous forms; mismatches raising MismatchError on every rank with
nothing written; argument errors naming the argument."""
import numpy as np
import pytest

import gradsync as gs
from gsutil import (
    BF16,
    bits,
    check_reduction,
    check_result,
    check_unchanged,
    collectively,
    reduce_reference,
    reduce_tolerance,
)

pytestmark = pytest.mark.mpi

BIG = 5003  # rows of an over-threshold tensor (the small comm's 4 KiB)
MOVE_DTYPES = [np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8, np.uint8,
                                     np.int32, np.int64)] + [BF16]


def same_bits(got, expected, what):
    assert isinstance(got, np.ndarray), f"{what}: {type(got)} is not an ndarray"
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{what}: {got.dtype} {got.shape}, expected {expected.dtype} {expected.shape}")
    assert np.array_equal(bits(got), bits(expected)), f"{what}: values differ"


def split_counts(inputs, tag, size, zeros=True):
    """send[s][d]: rows rank s sends rank d (0, 1, odd, and past BIG)."""
    rng = inputs.rng(tag=tag)
    choices = [0, 1, 3, 17, 2 * size + 1] if zeros else [1, 3, 17]
    counts = rng.choice(choices, size=(size, size))
    counts[0, -1] = BIG  # one block past the fusion threshold
    return counts.astype(np.int64)


# ---------------------------------------------------------------- alltoall

@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_alltoall_even_split(dtype, comm, inputs):
    P, me = comm.size, comm.rank
    shapes = [(0, 3), (P, 2), (3 * P,), (P * 7, 5)]
    per_rank = inputs.all_ranks(shapes, dtype, "bits")
    with collectively():
        out = comm.alltoall([a.copy() for a in per_rank[me]])
        assert isinstance(out, list) and len(out) == len(shapes)
        for i, s in enumerate(shapes):
            k = s[0] // P
            expected = np.concatenate([per_rank[r][i][me * k:(me + 1) * k] for r in range(P)])
            same_bits(out[i], expected, f"tensor {i} {s}")
    with collectively():  # one array in, one array out
        one = comm.alltoall(per_rank[me][3].copy())
        assert isinstance(one, np.ndarray)


@pytest.mark.parametrize("which", ["default", "small_threshold"])
def test_alltoall_uneven(which, comm, small_comm, inputs):
    c = small_comm if which == "small_threshold" else comm
    P, me = c.size, c.rank
    send = split_counts(inputs, "split", P)
    rows = send.sum(axis=1)
    per_rank = [inputs.arrays(r, [(int(rows[r]), 3)], np.float32, tag="x")[0]
                for r in range(P)]

    def block(s, d):
        start = int(send[s, :d].sum())
        return per_rank[s][start:start + send[s, d]]

    expected = np.concatenate([block(s, me) for s in range(P)])
    x = per_rank[me].copy()
    with collectively(what="counts exchanged"):
        got = c.alltoall_counts(send[me])
        assert list(got) == list(send[:, me]), f"alltoall_counts gave {got}"
        out = c.alltoall(x, send[me])
        same_bits(out, expected, "uneven alltoall")
        check_unchanged([x], [per_rank[me]])
    with collectively(what="recv_counts given"):
        out2 = c.alltoall(x, send[me], recv_counts=send[:, me])
        same_bits(out2, expected, "uneven alltoall with recv_counts")
    with collectively(what="async into out"):
        buf = np.full_like(expected, np.nan)
        req = c.alltoall_async(x, buf, send[me], send[:, me])
        assert req.wait() is buf
        same_bits(buf, expected, "alltoall_async")


def test_alltoall_zero_width_rows(comm):
    P = comm.size
    x = np.empty((2 * P, 0), np.float64)
    with collectively():
        out = comm.alltoall(x)
        assert out.shape == (2 * P, 0), out.shape


def test_alltoall_counts_mismatch_on_every_rank(comm):
    P, me = comm.size, comm.rank
    if P == 1:
        pytest.skip("needs two ranks to disagree")
    send = [2] * P
    recv = [2] * P
    if me == P - 1:
        recv[0] = 3  # expects one row more from rank 0 than it sends
    x = np.arange(2 * P, dtype=np.int32)
    out = np.full(sum(recv), -7, np.int32)
    with collectively():
        with pytest.raises(gs.MismatchError, match="expects 3"):
            comm.alltoall(x, send, recv_counts=recv, out=out)
        assert np.all(out == -7), "a failed alltoall wrote into out"


def test_alltoall_argument_errors(comm):
    P, me = comm.size, comm.rank
    if P > 1:
        with collectively(what="not divisible on one rank"):
            x = np.zeros(2 * P + (1 if me == 0 else 0), np.float32)
            expected = gs.ArgumentError if me == 0 else gs.MismatchError
            with pytest.raises(expected, match="rows" if me == 0 else "rank"):
                comm.alltoall(x)
    with collectively(what="wrong number of counts"):
        with pytest.raises(gs.ArgumentError, match="send_counts"):
            comm.alltoall(np.zeros(P, np.float32), [1] * (P + 1))
    with collectively(what="counts do not add up"):
        with pytest.raises(gs.ArgumentError, match="send_counts"):
            comm.alltoall(np.zeros(P + 1, np.float32), [1] * P)
    with collectively(what="0-d"):
        with pytest.raises(gs.ArgumentError, match="0-d"):
            comm.alltoall(np.float32(3))


# ---------------------------------------------------------------- gather / scatter

@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_gather_variable_rows_every_root(dtype, comm, inputs):
    P, me = comm.size, comm.rank
    rows = [0, 1, 7, BIG]
    per_rank = [inputs.arrays(r, [(rows[r % 4], 2)], dtype, "bits")[0] for r in range(P)]
    expected = np.concatenate(per_rank)
    for root in range(P):
        with collectively(what=f"root {root}"):
            x = per_rank[me].copy()
            out = comm.gather(x, root=root)
            if me == root:
                same_bits(out, expected, f"gather at root {root}")
            else:
                assert out is None, "gather returns None off the root"
            check_unchanged([x], [per_rank[me]])
        with collectively(what=f"root {root}, counts given, list"):
            outs = comm.gather([x, x[:1]], root=root,
                               counts=[[rows[r % 4] for r in range(P)],
                                       [min(1, rows[r % 4]) for r in range(P)]])
            if me == root:
                same_bits(outs[0], expected, "gather list[0]")
                same_bits(outs[1], np.concatenate([a[:1] for a in per_rank]), "gather list[1]")


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_scatter_every_root(dtype, comm, inputs):
    P, me = comm.size, comm.rank
    counts = [(3 * r + 1) % 5 for r in range(P)]
    counts[-1] += BIG
    for root in range(P):
        whole = inputs.arrays(root, [(sum(counts), 3)], dtype, "bits", tag=root)[0]
        start = sum(counts[:me])
        with collectively(what=f"root {root}"):
            out = comm.scatter(whole.copy() if me == root else None, root=root, counts=counts)
            same_bits(out, whole[start:start + counts[me]], f"scatter from {root}")
        with collectively(what=f"root {root}, even split"):
            even = whole[:P * 2]
            out = comm.scatter(even.copy() if me == root else None, root=root)
            same_bits(out, even[2 * me:2 * me + 2], "even scatter")


def test_gather_scatter_async(comm, inputs):
    P, me = comm.size, comm.rank
    per_rank = inputs.all_ranks([(3, 4)], np.float64)
    root = P - 1
    whole = np.full((3 * P, 4), np.nan) if me == root else None
    back = np.zeros((3, 4))
    with collectively():
        r1 = comm.gather_async(per_rank[me][0], whole, root=root)
        r2 = comm.scatter_async(whole, back, root=root)
        assert r2.wait() is back
        r1.wait()
        if me == root:
            same_bits(whole, np.concatenate([p[0] for p in per_rank]), "gather_async")
        same_bits(back, per_rank[me][0], "scatter_async of the gathered rows")


def test_gather_scatter_errors(comm):
    P, me = comm.size, comm.rank
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with collectively(what="root out of range"):
        with pytest.raises(gs.ArgumentError, match="root"):
            comm.gather(x, root=P, counts=[3] * P)
    if P > 1:
        with collectively(what="roots differ"):
            with pytest.raises(gs.MismatchError, match="root"):
                comm.gather(x, root=me % 2)
        with collectively(what="counts disagree: nothing written"):
            counts = [3] * P
            if me == 1:
                counts[0] = 4
            out = np.full((sum(counts), 2), -1, np.float32) if me == 0 else None
            with pytest.raises(gs.MismatchError, match="counts"):
                comm.gather(np.zeros((3, 2), np.float32), root=0, counts=counts, out=out)
            if me == 0:
                assert np.all(out == -1)
    with collectively(what="scatter counts do not add up at the root"):
        bad = np.zeros((P + 1, 2), np.float32)
        expected = gs.ArgumentError if me == 0 else gs.MismatchError
        with pytest.raises(expected):
            comm.scatter(bad if me == 0 else None, root=0, counts=[1] * P)


# ---------------------------------------------------------------- reduce

REDUCE_CASES = [(op, np.dtype(d)) for op in ("sum", "average", "min", "max")
                for d in (np.float16, BF16, np.float32, np.float64)] + \
               [(op, np.dtype(d)) for op in ("sum", "min", "max")
                for d in (np.int8, np.uint8, np.int32, np.int64)] + \
               [("prod", np.dtype(np.float32)), ("prod", np.dtype(np.int32))]


@pytest.mark.parametrize("op,dtype", REDUCE_CASES, ids=lambda v: str(v))
def test_reduce_every_op(op, dtype, small_comm, inputs):
    c = small_comm
    P, me = c.size, c.rank
    shapes = [(0,), (1,), (13,), (BIG,), (3, 7)]
    kind = "prod" if op == "prod" else "normal"
    per_rank = inputs.all_ranks(shapes, dtype, kind)
    root = len(op) % P
    with collectively():
        mine = [a.copy() for a in per_rank[me]]
        out = c.reduce(mine, op, root=root)
        check_unchanged(mine, per_rank[me])
        if me == root:
            check_reduction(out, per_rank, op, shapes, dtype)
        else:
            assert out is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16],
                         ids=lambda d: np.dtype(d).name)
def test_reduce_in_place_scaled(dtype, comm, inputs):
    P, me = comm.size, comm.rank
    shapes = [(17,), (4, 5)]
    per_rank = inputs.all_ranks(shapes, dtype)
    for root in range(P):
        mine = [a.copy() for a in per_rank[me]]
        with collectively(what=f"root {root}"):
            got = comm.reduce_(mine, "average", root=root, prescale=0.5, postscale=3.0)
            assert got is mine
            if me == root:
                check_reduction(mine, per_rank, "average", shapes, dtype, 0.5, 3.0)
            else:
                check_unchanged(mine, per_rank[me])
        mine = [a.copy() for a in per_rank[me]]
        with collectively(what=f"async root {root}"):
            req = comm.reduce_async_(mine[0], "sum", root=root, postscale=2.0)
            assert req.wait() is mine[0]
            if me == root:
                col = [p[0] for p in per_rank]
                check_result(mine[0], reduce_reference(col, "sum", 1.0, 2.0),
                             reduce_tolerance(col, "sum", 1.0, 2.0), dtype, shapes[0])


def test_reduce_errors(comm):
    P, me = comm.size, comm.rank
    x = np.arange(4, dtype=np.int32)
    with collectively(what="average of integers"):
        with pytest.raises(TypeError, match="average"):
            comm.reduce(x, "average")
        assert np.array_equal(x, np.arange(4, dtype=np.int32))
    with collectively(what="adasum"):
        with pytest.raises(gs.ArgumentError, match="allreduce"):
            comm.reduce(x.astype(np.float32), "adasum")
    with collectively(what="unknown op"):
        with pytest.raises(ValueError, match="op"):
            comm.reduce(x, "mean")
    if P > 1:
        with collectively(what="ops differ"):
            with pytest.raises(gs.MismatchError, match="op"):
                comm.reduce(x, "sum" if me else "max")
        with collectively(what="read-only at the root only"):
            y = np.arange(4, dtype=np.int32)
            y.flags.writeable = me != 0
            expected = gs.ArgumentError if me == 0 else gs.MismatchError
            with pytest.raises(expected):
                comm.reduce_(y, root=0)
