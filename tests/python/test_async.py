"""Asynchronous collectives (issue 7): many requests in flight complete with
the right results in any wait order, errors surface at wait() on every rank,
requests keep their arrays alive, blocking calls wait for queued ones; and
gs.Arena's views reduce as one message with no copies."""
import gc
import weakref

import numpy as np
import pytest

import gradsync as gs
from gsutil import collectively, seed_for

pytestmark = pytest.mark.mpi

SIZES = [0, 1, 7, 1000, 70001]  # the last passes the tests' fusion threshold


def rank_data(comm, tag, i, n, dtype=np.float64):
    """Rank r's tensor i, and the float64 sum over ranks, regenerated locally."""
    def one(r):
        rng = np.random.default_rng(seed_for("async", tag, i, r))
        return rng.integers(-50, 50, n).astype(dtype)
    return one(comm.rank), sum(one(r).astype(np.float64) for r in range(comm.size))


@pytest.mark.parametrize("order", ["issue", "reverse", "shuffled", "test-poll"])
def test_many_in_flight_any_wait_order(comm, order):
    k = 12
    mine, refs, reqs = [], [], []
    for j in range(k):
        tensors, sums = zip(*[rank_data(comm, j, i, n) for i, n in enumerate(SIZES)])
        tensors = list(tensors)
        mine.append(tensors)
        refs.append(sums)
        op = "average" if j % 2 else "sum"
        reqs.append(comm.allreduce_async_(tensors, op=op))
    idx = list(range(k))
    if order == "reverse":
        idx.reverse()
    elif order == "shuffled":
        np.random.default_rng(seed_for("order")).shuffle(idx)
    results = {}
    if order == "test-poll":
        while len(results) < k:
            for j in range(k):
                if j not in results and reqs[j].test():
                    results[j] = reqs[j].wait()
    else:
        for j in idx:
            results[j] = reqs[j].wait()
    with collectively():
        for j in range(k):
            assert results[j] is mine[j], "wait() returns what the call was given"
            assert reqs[j].done
            scale = 1.0 / comm.size if j % 2 else 1.0
            for got, ref in zip(mine[j], refs[j]):
                np.testing.assert_allclose(got, ref * scale, rtol=1e-12)


def test_single_array_and_float32(comm):
    x, ref = rank_data(comm, "single", 0, 333, np.float32)
    r = comm.allreduce_async_(x, prescale=2.0)
    out = r.wait()
    with collectively():
        assert out is x
        np.testing.assert_allclose(x, 2 * ref, rtol=1e-6)
        assert "done" in repr(r)


def test_request_keeps_arrays_alive(comm):
    """The caller may drop its references: the request holds the arrays until
    the collective is done, and wait() hands them back."""
    x, ref = rank_data(comm, "alive", 0, 50000)
    watch = weakref.ref(x)
    r = comm.allreduce_async_([x])
    del x
    gc.collect()
    out = r.wait()
    with collectively():
        assert watch() is out[0]
        np.testing.assert_allclose(out[0], ref)


def test_blocking_call_waits_for_queued_ones(comm):
    """Issue order is kept: a blocking broadcast after async allreduces of the
    same array sees their result."""
    x, ref = rank_data(comm, "order", 0, 2000)
    reqs = [comm.allreduce_async_(x) for _ in range(3)]
    comm.broadcast_(x, root=comm.size - 1)   # waits for the three first
    with collectively():
        assert all(r.done for r in reqs)
        np.testing.assert_allclose(x, ref * comm.size ** 2, rtol=1e-12)


def test_other_async_collectives(comm):
    p = comm.size
    b = np.full(17, float(comm.rank))
    rb = comm.broadcast_async_([b], root=p - 1)
    numels = [5, 3, 2]  # one owner: tensors must not cross a rank's range
    ts = [np.full(n, float(comm.rank + 1)) for n in numels]
    layout = gs.ShardLayout(numels, p)
    rs = comm.reduce_scatter_shards_async_(ts, op="sum")
    rs.wait()
    ag = comm.allgather_shards_async_(ts)
    rb.wait()
    ag.wait()
    with collectively():
        np.testing.assert_array_equal(b, np.full(17, float(p - 1)))
        total = p * (p + 1) / 2
        for t in ts:
            np.testing.assert_array_equal(t, np.full(t.shape, total))
        assert layout.total == sum(numels)


def test_mismatch_raises_at_wait_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    n = 10 if comm.rank == 0 else 11
    x = np.ones(n)
    before = x.copy()
    r = comm.allreduce_async_(x)
    with collectively():
        with pytest.raises(gs.MismatchError):
            r.wait()
        np.testing.assert_array_equal(x, before)
        assert r.done
    # the communicator still works afterwards
    y = np.ones(4)
    comm.allreduce_async_(y).wait()
    with collectively():
        np.testing.assert_array_equal(y, np.full(4, float(comm.size)))


def test_bad_argument_on_one_rank(comm):
    """A local argument error raises at the call on that rank; the others'
    requests fail with MismatchError instead of hanging."""
    if comm.size < 2:
        pytest.skip("needs two ranks")
    good = np.ones(8)
    bad = np.ones((4, 4))[:, ::2]  # not contiguous
    with collectively():
        if comm.rank == 0:
            with pytest.raises(ValueError, match="contiguous"):
                comm.allreduce_async_([bad])
        else:
            r = comm.allreduce_async_([good])
            with pytest.raises(gs.MismatchError):
                r.wait()
            np.testing.assert_array_equal(good, np.ones(8))


def test_arena_views_reduce_as_one_message(comm):
    shapes = [(3, 4), 5, (0,), (2, 2, 2), (1000,)]
    arena = gs.Arena(shapes, np.float32)
    rng = np.random.default_rng(seed_for("arena", comm.rank))
    for v in arena.views:
        v[...] = rng.integers(-9, 9, v.shape)
    local = [v.copy() for v in arena.views]
    ref = comm.allreduce([v.astype(np.float64) for v in local])
    before = comm.stats()
    comm.allreduce_(arena.views)
    after = comm.stats()
    sent = sum(after[k] - before[k] for k in ("messages", "rode_in_check"))
    r = comm.allreduce_async_(arena.buffer, op="average")
    r.wait()
    with collectively():
        assert [v.shape for v in arena.views] == [(3, 4), (5,), (0,), (2, 2, 2), (1000,)]
        assert all(np.shares_memory(v, arena.buffer) for v in arena.views if v.size)
        assert arena.offsets == [0, 12, 17, 17, 25]
        assert sent == 1, "the views must go as one message (or ride in validation)"
        for v, rf in zip(arena.views, ref):
            np.testing.assert_allclose(v, rf, rtol=1e-6)  # sum, then average of equal sums
        arena.zero_()
        assert not arena.buffer.any()
        with pytest.raises(ValueError):
            gs.Arena([(2, -1)])
        with pytest.raises(TypeError):
            gs.Arena([3], np.complex64)
