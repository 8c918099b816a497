"""Lists of about 1.5 MiB in scattered allocations, where the tensors of
256 KiB or more go as their own messages in their own memory and the rest are
fused: every op and dtype, in and out of place, with scales, against the
float64 reference; bitwise identical on every rank."""
import numpy as np
import pytest

from gsutil import ALL_DTYPES, check_reduction, collectively, is_int, random_array, seed_for

pytestmark = pytest.mark.mpi
LIST_BYTES = 1 << 20


def scattered(dtype, seed, rank, nranks, kind):
    """~1.5 MiB in 9 tensors of random odd sizes, each its own allocation."""
    shape_rng = np.random.default_rng(seed_for(seed, "shapes"))  # same on every rank
    rng = np.random.default_rng(seed_for(seed, rank))
    itemsize = np.dtype(dtype).itemsize
    n_total = (3 * LIST_BYTES // 2) // itemsize
    cuts = np.sort(shape_rng.choice(np.arange(1, n_total), size=8, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [n_total]]))
    sizes[3] = 0  # an empty tensor inside the message
    return [random_array(rng, (int(s),), dtype, kind=kind, nranks=nranks) for s in sizes]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "prod"])
def test_large_scattered_list_matches_reference(comm, dtype, op):
    if op == "average" and is_int(dtype):
        pytest.skip("average needs floating dtypes")
    kind = "prod" if op == "prod" else "normal"
    pre, post = (0.5, 3.0) if not is_int(dtype) and op in ("sum", "average") else (1.0, 1.0)
    tag = f"large-{dtype}-{op}"
    per_rank = [scattered(dtype, tag, r, comm.size, kind) for r in range(comm.size)]
    mine = [a.copy() for a in per_rank[comm.rank]]
    outs = comm.allreduce(mine, op=op, prescale=pre, postscale=post)
    inplace = comm.allreduce_([a.copy() for a in mine], op=op, prescale=pre, postscale=post)
    with collectively(None, f"large list {dtype} {op}") as blk:
        shapes = [a.shape for a in mine]
        check_reduction(outs, per_rank, op, shapes, dtype, pre, post)
        assert all(np.array_equal(o.view(np.uint8), i.view(np.uint8))
                   for o, i in zip(outs, inplace)), "in place differs from out of place"
        assert all(np.array_equal(a, b) for a, b in zip(mine, per_rank[comm.rank])), \
            "out-of-place call changed its inputs"
        blk.same(outs)
