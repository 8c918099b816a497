"""gs.ShardLayout (ONNX Runtime's NcclAllGather / NcclReduceScatter layout)
and the two fused shard collectives."""

import numpy as np
import pytest

import gradsync as gs
from gsutil import (
    BF16,
    bits,
    check_result,
    collective_assert,
    collectively,
    reduce_reference,
    reduce_tolerance,
)

pytestmark = pytest.mark.mpi


def ref_layout(counts, size):
    """Independent reimplementation of the contract's arithmetic.
    Returns (total, padded, rank_count, offsets, owners) or None if some
    tensor does not end inside its owner's range."""
    total = sum(counts)
    align = size * 32
    padded = total + align - total % align
    rank_count = padded // size
    offsets, owners, off = [], [], 0
    for n in counts:
        offsets.append(off)
        owner = off // rank_count
        if off + n > (owner + 1) * rank_count:
            return None
        owners.append(owner)
        off += n
    return total, padded, rank_count, offsets, owners


def layout_values(layout, n, size):
    return (int(layout.total), int(layout.padded), int(layout.rank_count),
            [int(o) for o in layout.offsets],
            [int(layout.owner(i)) for i in range(n)])


# ------------------------------------------------------------- ShardLayout

KNOWN = [
    # counts, size, padded, rank_count, offsets, owners
    ([40, 24, 8], 2, 128, 64, [0, 40, 64], [0, 0, 1]),
    ([64], 2, 128, 64, [0], [0]),
    ([64, 40, 24, 64, 30], 4, 256, 64, [0, 64, 104, 128, 192],
     [0, 1, 1, 2, 3]),
]


@pytest.mark.parametrize("counts,size,padded,rank_count,offsets,owners",
                         KNOWN, ids=["2x[40,24,8]", "2x[64]", "4x5"])
def test_known_layouts(counts, size, padded, rank_count, offsets, owners):
    with collectively():
        lay = gs.ShardLayout(counts, size)
        got = layout_values(lay, len(counts), size)
        assert got == (sum(counts), padded, rank_count, offsets, owners), got
        for r in range(size):
            assert [int(i) for i in lay.owned(r)] == [
                i for i, o in enumerate(owners) if o == r], r


def test_total_multiple_of_align_still_adds_a_block():
    with collectively():
        lay = gs.ShardLayout([64], 2)
        assert int(lay.padded) == 128 and int(lay.rank_count) == 64
        lay = gs.ShardLayout([64, 64], 4)
        assert int(lay.padded) == 256


def test_split_tensor_raises():
    with collectively():
        with pytest.raises(ValueError,
                           match="a single rank must own the entire tensor"):
            gs.ShardLayout([60, 10], 2)


def test_random_layouts_match_reference(inputs):
    rng = inputs.rng(None)
    checked = invalid = 0
    with collectively():
        for size in range(1, 9):
            for _ in range(40):
                k = int(rng.integers(1, 8))
                counts = [int(c) for c in rng.integers(0, 100, k)]
                ref = ref_layout(counts, size)
                if ref is None:
                    invalid += 1
                    with pytest.raises(ValueError):
                        gs.ShardLayout(counts, size)
                    continue
                checked += 1
                got = layout_values(gs.ShardLayout(counts, size), k, size)
                assert got == ref, (counts, size, got, ref)
        assert checked > 50 and invalid > 20, (checked, invalid)


# ------------------------------------------------------ shard collectives

def generic_counts(size):
    # 2*size tensors of 32 elements: always a valid layout, owners spread
    counts = [32] * (2 * size)
    assert ref_layout(counts, size) is not None
    return counts


CASES = {
    "2x[40,24,8]": (2, [(8, 5), (24,), (8,)]),
    "2x[64]": (2, [(64,)]),
    "4x5": (4, [(64,), (40,), (4, 6), (8, 8), (30,)]),
}


def case_shapes(case, size):
    if case == "generic":
        return [(n,) for n in generic_counts(size)]
    want, shapes = CASES[case]
    if want != size:
        pytest.skip("layout %s needs %d ranks" % (case, want))
    return shapes


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.int64),
                                   BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("case", ["2x[40,24,8]", "2x[64]", "4x5", "generic"])
def test_allgather_shards(case, dtype, comm, inputs):
    P, me = comm.size, comm.rank
    shapes = case_shapes(case, P)
    counts = [int(np.prod(s)) for s in shapes]
    owners = ref_layout(counts, P)[4]
    per_rank = inputs.all_ranks(shapes, dtype, "bits")
    mine = [a.copy() for a in per_rank[me]]
    with collectively():
        out = comm.allgather_shards_(mine)
        assert isinstance(out, list) and len(out) == len(mine)
        for i, o in enumerate(owners):
            assert out[i] is mine[i], "allgather_shards_ returns its inputs"
            assert mine[i].shape == shapes[i]
            assert np.array_equal(bits(mine[i]), bits(per_rank[o][i])), (
                "tensor %d does not hold its owner's (rank %d) values"
                % (i, o))


@pytest.mark.parametrize("op,dtype", [("sum", np.dtype(np.int32)),
                                      ("sum", np.dtype(np.float32)),
                                      ("average", np.dtype(np.float64)),
                                      ("max", np.dtype(np.float16))],
                         ids=["sum-int32", "sum-float32", "average-float64",
                              "max-float16"])
@pytest.mark.parametrize("case", ["2x[40,24,8]", "2x[64]", "4x5", "generic"])
def test_reduce_scatter_shards(case, op, dtype, comm, inputs):
    P, me = comm.size, comm.rank
    shapes = case_shapes(case, P)
    counts = [int(np.prod(s)) for s in shapes]
    owners = ref_layout(counts, P)[4]
    kind = "full" if op == "max" else "normal"
    per_rank = inputs.all_ranks(shapes, dtype, kind)
    mine = [a.copy() for a in per_rank[me]]
    with collectively():
        out = comm.reduce_scatter_shards_(mine, op=op)
        assert isinstance(out, list) and len(out) == len(mine)
        for i, o in enumerate(owners):
            assert out[i] is mine[i]
            if o == me:
                col = [per_rank[r][i] for r in range(P)]
                check_result(mine[i], reduce_reference(col, op),
                             reduce_tolerance(col, op), dtype, shapes[i],
                             what="owned tensor %d" % i)
            else:
                assert np.array_equal(bits(mine[i]), bits(per_rank[me][i])), (
                    "tensor %d (owned by rank %d) was modified on rank %d"
                    % (i, o, me))


def test_shard_mixed_dtypes_raise_typeerror(comm):
    counts = generic_counts(comm.size)
    ts = [np.ones(n, dtype=np.float32 if i % 2 else np.float64)
          for i, n in enumerate(counts)]
    before = [t.copy() for t in ts]
    with collectively(what="allgather_shards_"):
        with pytest.raises(TypeError):
            comm.allgather_shards_(ts)
    with collectively(what="reduce_scatter_shards_"):
        with pytest.raises(TypeError):
            comm.reduce_scatter_shards_(ts)
        for a, b in zip(ts, before):
            assert np.array_equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_shard_call_with_split_tensor_raises(comm):
    # a layout where a tensor straddles rank 0's and rank 1's ranges
    counts = [60, 10]
    collective_assert(ref_layout(counts, comm.size) is None, "bad layout")
    ts = [np.ones(n, dtype=np.float32) for n in counts]
    with collectively():
        with pytest.raises(ValueError, match="single rank must own"):
            comm.allgather_shards_(ts)
    # the communicator still works
    with collectively():
        out = comm.allreduce(np.ones(3, np.float32))
        assert np.all(out == comm.size)
