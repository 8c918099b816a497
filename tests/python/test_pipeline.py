"""Pipelined host allreduce: messages larger than GRADSYNC_PIPELINE_BYTES go
in pieces, each packed, reduced and scaled or unpacked before the next.

The pieces here are tiny (256 bytes: 64 float32, 32 float64, 128 float16
elements), so tensor boundaries fall inside pieces and pieces inside tensors,
on every path: one tensor in place, a tensor list reduced in the fusion
buffer, views carved back to back out of one allocation (reduced where they
lie), out of place, with scales. Results are checked against a float64
(int64) NumPy reference and, bit for bit, against the same call on a
communicator that sends whole messages; the ranks must agree on the piece
size like on the fusion threshold."""

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    check_reduction,
    check_unchanged,
    collective_assert,
    collectively,
    dtype_name,
    environment,
)

pytestmark = pytest.mark.mpi
PIECE = 256  # bytes


def pipeline_env(nbytes):
    """GRADSYNC_PIPELINE_BYTES for the communicators created inside."""
    return environment("GRADSYNC_PIPELINE_BYTES", nbytes)


@pytest.fixture(scope="module")
def piped_and_whole():
    """Two communicators over the world: pieces of PIECE bytes, and whole
    messages; a small fusion threshold so lists make several messages."""
    with pipeline_env(PIECE):
        piped = gs.Communicator(MPI.COMM_WORLD, fusion_threshold=4096)
    with pipeline_env(0):
        whole = gs.Communicator(MPI.COMM_WORLD, fusion_threshold=4096)
    yield piped, whole
    piped.close()
    whole.close()


def carved(arrays):
    """The same values as views back to back in one allocation."""
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0)
    views, at = [], 0
    for a in arrays:
        views.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return views


# sizes around the piece boundaries, a tensor of many pieces, and a list
# that spans several messages and crosses pieces mid-tensor
SHAPES = {
    "one": [(1000,)],
    "edges": [(63,), (64,), (65,), (1,), (0,), (127,), (129,)],
    "many": [(n,) for n in (5, 0, 70, 1, 333, 64, 17, 400, 2, 999)],
    "big": [(3,), (5003,), (7, 11)],
}
CASES = [
    ("sum", 1.0, 1.0),
    ("average", 1.0, 1.0),
    ("sum", 0.5, 3.0),
    ("max", 1.0, 1.0),
]


@pytest.mark.parametrize("layout", ["separate", "carved"])
@pytest.mark.parametrize("inplace", [True, False], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("op,prescale,postscale", CASES,
                         ids=[f"{o}-pre{a:g}-post{b:g}" for o, a, b in CASES])
@pytest.mark.parametrize("shapes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32],
                         ids=dtype_name)
def test_pieces_match_reference_and_whole_messages(dtype, shapes, op, prescale, postscale,
                                                   inplace, layout, piped_and_whole, inputs):
    if np.dtype(dtype).kind == "i" and (op == "average" or prescale != 1.0):
        pytest.skip("integers take no scales (tested in test_allreduce)")
    piped, whole = piped_and_whole
    shapes = SHAPES[shapes]
    per_rank = inputs.all_ranks(shapes, dtype)
    results = {}
    for name, c in (("piped", piped), ("whole", whole)):
        mine = [a.copy() for a in per_rank[c.rank]]
        if layout == "carved":
            mine = carved(mine)
        copies = [a.copy() for a in mine]
        with collectively(what=name) as blk:
            kw = dict(op=op, prescale=prescale, postscale=postscale)
            outs = c.allreduce_(mine, **kw) if inplace else c.allreduce(mine, **kw)
            check_reduction(outs, per_rank, op, shapes, dtype, prescale, postscale,
                            what=f"{name} tensor")
            if not inplace:
                check_unchanged(mine, copies)
            blk.same(outs)
        results[name] = [o.copy() for o in outs]
    with collectively(what="piped against whole"):
        for i, (a, b) in enumerate(zip(results["piped"], results["whole"])):
            # the same reduction per element, whichever piece carries it
            # (the MPI library may pick another algorithm for a smaller
            # message past 2 ranks: rounding may then differ)
            if MPI.COMM_WORLD.size <= 2 or np.dtype(dtype).kind == "i":
                assert a.tobytes() == b.tobytes(), f"tensor {i} differs from the whole message"


def test_one_message_counts_once(piped_and_whole):
    """Pieces are not messages: the counters count fused messages."""
    piped, whole = piped_and_whole
    xs = [np.ones(n, np.float32) for n in (3000, 5, 7000)]
    counts = []
    for c in (piped, whole):
        before = c.stats()
        c.allreduce_(xs)
        after = c.stats()
        counts.append(after["messages"] - before["messages"])
    collective_assert(counts[0] == counts[1] == 3, f"messages piped/whole: {counts}")


@pytest.mark.skipif(MPI.COMM_WORLD.size < 2, reason="needs two ranks")
def test_ranks_disagreeing_on_the_piece_size_raise_everywhere():
    world = MPI.COMM_WORLD
    with pipeline_env(PIECE if world.rank == 0 else 2 * PIECE):
        c = gs.Communicator(world)
    try:
        x = np.arange(1000, dtype=np.float32)
        before = x.copy()
        with collectively():
            with pytest.raises(gs.MismatchError, match="GRADSYNC_PIPELINE_BYTES"):
                c.allreduce_(x)
            assert np.array_equal(x, before), "a refused call wrote its tensor"
    finally:
        c.close()


def test_unparsable_or_negative_piece_size_falls_back_to_default():
    """Like every GRADSYNC_ knob: an unusable value means the default, and the
    communicator still reduces correctly."""
    for bad in ("-5", "1MiB"):
        with pipeline_env(bad):
            c = gs.Communicator(MPI.COMM_WORLD)
        try:
            x = np.full(300_000, 1.0, np.float32)  # > the 1 MiB default piece
            c.allreduce_(x)
            collective_assert(np.all(x == MPI.COMM_WORLD.size), f"{bad}: wrong sum")
        finally:
            c.close()
