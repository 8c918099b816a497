"""Point-to-point messages: send/recv_ and their asynchronous forms against the
sender's bytes, matching by tag and order, overlap with queued collectives
(in both directions), a receive of the wrong dtype or size raising
MismatchError on the receiver, argument errors naming the argument, and a
receive nobody sends to ending in TimeoutError instead of a hang."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import BF16, bits, collectively

pytestmark = pytest.mark.mpi

DTYPES = [np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8, np.uint8,
                                np.int32, np.int64)] + [BF16]


def same_bits(got, expected, what):
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert np.array_equal(bits(got), bits(expected)), f"{what}: values differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_ring_every_dtype_and_size(dtype, comm, inputs):
    P, me = comm.size, comm.rank
    nxt, prev = (me + 1) % P, (me - 1) % P
    shapes = [(0,), (1,), (17, 3), (70001,)]  # the last is past MPICH's eager limit
    per_rank = inputs.all_ranks(shapes, dtype, "bits")
    with collectively():
        got = [np.zeros(s, dtype) for s in shapes]
        r = comm.recv_async_(got, prev, tag=9)
        s = comm.send_async(per_rank[me], nxt, tag=9)
        assert s.wait() is per_rank[me]
        assert r.wait() is got
        for i in range(len(shapes)):
            same_bits(got[i], per_rank[prev][i], f"tensor {i}")


def test_tags_keep_messages_apart_and_order_is_kept(comm):
    P, me = comm.size, comm.rank
    nxt, prev = (me + 1) % P, (me - 1) % P
    with collectively():
        a, b, c = (np.zeros(3, np.int64) for _ in range(3))
        # receives posted in another order than the sends: tag, then order, decides
        rb = comm.recv_async_(b, prev, tag=2)
        ra = comm.recv_async_(a, prev, tag=1)
        rc = comm.recv_async_(c, prev, tag=1)
        sends = [comm.send_async(np.full(3, 10 * me + k, np.int64),
                                 nxt, tag=t) for k, t in enumerate([1, 2, 1])]
        for q in sends + [ra, rb, rc]:
            q.wait()
        assert list(a) == [10 * prev] * 3, a
        assert list(b) == [10 * prev + 1] * 3, b
        assert list(c) == [10 * prev + 2] * 3, c


def test_blocking_pairs(comm, inputs):
    P, me = comm.size, comm.rank
    if me >= P - P % 2:
        pytest.skip("no partner at this rank")
    peer = me ^ 1
    x = inputs.arrays(me, [(1001, 2)], np.float32)[0]
    y = np.zeros_like(x)
    if me % 2 == 0:
        comm.send(x, peer, tag=5)
        comm.recv_(y, peer, tag=5)
    else:
        comm.recv_(y, peer, tag=5)
        comm.send(x, peer, tag=5)
    same_bits(y, inputs.arrays(peer, [(1001, 2)], np.float32)[0], "pair")


def test_p2p_overlaps_queued_collectives(comm):
    """A receive posted before a blocking collective whose matching send
    comes after that collective on the other rank: point-to-point calls do
    not wait for, nor hold up, collectives."""
    P, me = comm.size, comm.rank
    nxt, prev = (me + 1) % P, (me - 1) % P
    big = 1 << 18  # rendezvous-sized
    got = np.zeros(big, np.float32)
    with collectively():
        r = comm.recv_async_(got, prev, tag=3)
        acc = np.ones(8)
        pending = comm.allreduce_async_(acc)
        comm.barrier()  # the other ranks' sends come after this
        s = comm.send_async(np.full(big, me, np.float32), nxt, tag=3)
        pending.wait()
        s.wait()
        r.wait()
        assert np.all(got == prev) and np.all(acc == P)


@pytest.mark.parametrize("what", ["dtype", "size"])
def test_mismatch_raises_on_the_receiver(what, comm):
    P, me = comm.size, comm.rank
    nxt, prev = (me + 1) % P, (me - 1) % P
    with collectively():
        wrong = np.arange(6, dtype=np.int32) if what == "dtype" else np.arange(7, dtype=np.float32)
        s1 = comm.send_async(wrong, nxt, tag=4)
        s2 = comm.send_async(np.arange(6, dtype=np.float32), nxt, tag=4)
        y = np.zeros(6, np.float32)
        with pytest.raises(gs.MismatchError, match="int32" if what == "dtype" else "7"):
            comm.recv_(y, prev, tag=4)
        comm.recv_(y, prev, tag=4)  # the next message still matches
        assert np.array_equal(y, np.arange(6, dtype=np.float32))
        s1.wait()
        s2.wait()


def test_argument_errors(comm):
    P = comm.size
    x = np.zeros(3, np.float32)
    with pytest.raises(gs.ArgumentError, match="dest"):
        comm.send(x, P)
    with pytest.raises(gs.ArgumentError, match="source"):
        comm.recv_(x, -1)
    with pytest.raises(gs.ArgumentError, match="tag"):
        comm.send(x, 0, tag=-1)
    with pytest.raises(gs.ArgumentError, match="tag"):
        comm.send(x, 0, tag=comm.max_tag + 1)
    assert comm.max_tag >= 16383
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(gs.ArgumentError, match="read-only"):
        comm.recv_(ro, 0)
    with pytest.raises(TypeError, match="dtype"):
        comm.send(np.zeros(3, np.complex64), 0)
    with pytest.raises(gs.ArgumentError, match="contiguous"):
        comm.send(np.zeros((4, 4), np.float32)[:, 1], 0)
    MPI.COMM_WORLD.Barrier()


def test_receive_nobody_sends_times_out(comm):
    c = gs.Communicator()
    me, P = c.rank, c.size
    x = np.zeros(4, np.float32)
    gs.set_timeout(0.5)
    try:
        t0 = time.monotonic()
        with collectively():
            with pytest.raises(gs.TimeoutError, match="gs_recv"):
                c.recv_(x, (me + 1) % P, tag=77)
            assert time.monotonic() - t0 < 30
            with pytest.raises(gs.TimeoutError, match="unusable"):
                c.recv_async_(x, (me + 1) % P, tag=77).wait()
    finally:
        gs.set_timeout(None)
        c.close()
    assert np.all(x == 0)


def test_receive_from_any_source(comm):
    """Every rank sends rank 0 a pair of messages; rank 0 receives them
    without naming senders and gets each rank's pair once, from the sender
    it reports (blocking, then asynchronous)."""
    P, me = comm.size, comm.rank
    with collectively():
        if me != 0:
            comm.send([np.full(3, 100 * me + k, np.int64) for k in range(2)], 0, tag=31)
        else:
            got = {}
            for k in range(1, P):
                into = [np.zeros(3, np.int64), np.zeros(3, np.int64)]
                if k % 2:
                    _, src = comm.recv_any_(into, tag=31)
                else:
                    req = comm.recv_any_async_(into, tag=31)
                    assert req.wait() is into
                    src = req.source
                assert src not in got, f"rank {src} matched twice"
                got[src] = into
            assert sorted(got) == list(range(1, P))
            for src, into in got.items():
                assert [list(a) for a in into] == [[100 * src + k] * 3 for k in range(2)]


def test_probe_sees_without_taking(comm):
    P, me = comm.size, comm.rank
    if P < 2:
        pytest.skip("needs a sender")
    with collectively():
        assert comm.probe(tag=32) is None  # nobody has sent yet
    if me == P - 1:
        comm.send(np.arange(4.0), 0, tag=32)
    with collectively():
        if me == 0:
            deadline = time.monotonic() + 60
            while comm.probe(P - 1, tag=32) is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert comm.probe(tag=32) == P - 1
            y = np.zeros(4)
            comm.recv_(y, P - 1, tag=32)
            assert list(y) == [0.0, 1.0, 2.0, 3.0]
            assert comm.probe(tag=32) is None
        with pytest.raises(gs.ArgumentError, match="source"):
            comm.probe(P, tag=0)


def test_own_timeout_ends_a_receive(comm):
    """A communicator's own timeout: a receive nobody sends to ends after it,
    naming it; the process-wide setting (none here) and other communicators
    are untouched."""
    c = gs.Communicator()
    try:
        assert c.timeout is None
        c.timeout = 0.3
        assert c.timeout == 0.3
        with pytest.raises(ValueError, match="timeout"):
            c.timeout = -1
        x = np.zeros(4, np.float32)
        with collectively():
            with pytest.raises(gs.TimeoutError, match="communicator's timeout of 0.3 s"):
                c.recv_(x, c.rank, tag=77)
            with pytest.raises(gs.TimeoutError, match="unusable"):
                c.recv_any_(x, tag=77)
            comm.barrier()  # another communicator still works
    finally:
        c.close()
