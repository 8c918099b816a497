"""Small allreduces over the host's shared region (issue 47,
src/transport/shm/): with every rank on one host, a call of up to the
communicator's ride_bytes is validated and reduced in one exchange through a
memfd the ranks share, without MPI. Results against the rank-order fold
computed here in the dtype, bit for bit, for every dtype and op, in place and
out of place, one tensor and fused lists; the path really taken
(rode_in_check); a mismatch raises on every rank and writes nothing; a
refused region (a seccomp filter without memfd_create) falls back to MPI with
the same results; a peer SIGKILLed mid-call ends the survivor's wait with
gs.PeerLostError naming it (not at the timeout), and nothing is left in
/dev/shm."""
import signal

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    ALL_DTYPES,
    collectively,
    environment,
    is_int,
    left_fold,
    run_pair,
    scaled,
    shm_entries,
)

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
ON_ONE_HOST = WORLD.size > 1 and len(set(WORLD.allgather(MPI.Get_processor_name()))) == 1


@pytest.fixture(scope="module")
def comm():
    c = gs.Communicator()
    yield c
    c.close()


@pytest.fixture(scope="module")
def without_region():
    with environment("GRADSYNC_SHM_BYTES", 0):  # read when a communicator is made
        c = gs.Communicator()
    yield c
    c.close()


def test_ride_bytes_is_the_slot_on_one_host(comm, without_region):
    """A region when the ranks share a host: calls below the cross-memory
    threshold (1 MiB) ride, or, with that path off, a whole slot (about 1
    MiB); none at one rank or with GRADSYNC_SHM_BYTES=0 (MPI's 128 bytes)."""
    mpi_ride = gs.build_info()["check_payload_bytes"]
    with environment("GRADSYNC_CMA_BYTES", 0):
        no_cma = gs.Communicator()
    try:
        with collectively():
            assert without_region.ride_bytes == mpi_ride
            if ON_ONE_HOST:
                assert comm.ride_bytes == (1 << 20) - 1, comm.ride_bytes
                assert 1 << 20 <= no_cma.ride_bytes < (1 << 20) + 4096, no_cma.ride_bytes
            elif WORLD.size == 1:
                assert comm.ride_bytes == no_cma.ride_bytes == mpi_ride
    finally:
        no_cma.close()


# one tensor, sizes 1, odd, past MPI's 128 bytes, and most of a slot; lists
SHAPES = [[(1,)], [(17,)], [(33,)], [(3, 5), (1,), (0,), (1001,)], [(70001,)]]
CASES = [(dt, op) for dt in ALL_DTYPES for op in ("sum", "min", "max", "prod")
         if not (op == "prod" and is_int(dt))]
CASES += [(np.dtype(np.float32), "average"), (np.dtype(np.float64), "average")]


def _rode(c, fn):
    before = c.stats()
    out = fn()
    after = c.stats()
    return out, {k: after[k] - before[k] for k in ("rode_in_check", "messages", "validations")}


@pytest.mark.parametrize("dt,op", CASES, ids=[f"{d.name}-{o}" for d, o in CASES])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_rank_order_fold_bit_for_bit(comm, inputs, dt, op, in_place):
    for k, shapes in enumerate(SHAPES):
        per_rank = inputs.all_ranks(shapes, dt, kind="small" if is_int(dt) else "normal", tag=k)
        mine = [a.copy() for a in per_rank[WORLD.rank]]
        with collectively(what=f"{dt.name} {op} {shapes}") as blk:
            if in_place:
                outs, d = _rode(comm, lambda: comm.allreduce_(mine, op=op))
                outs = mine
            else:
                outs, d = _rode(comm, lambda: comm.allreduce(mine, op=op))
                for a, b in zip(mine, per_rank[WORLD.rank]):  # inputs untouched
                    assert a.tobytes() == b.tobytes()
            for i, out in enumerate(outs):
                ref = left_fold([r[i] for r in per_rank], op)
                assert out.dtype == dt and out.shape == ref.shape
                assert out.tobytes() == ref.tobytes(), (i, out.ravel()[:5], ref.ravel()[:5])
            if ON_ONE_HOST:  # one exchange validated and reduced it: no message of its own
                assert d == {"rode_in_check": 1, "messages": 0, "validations": 1}, d
            blk.same(outs)


def test_fused_list_with_scales(comm, inputs):
    """200 tensors of 768 floats (the issue's fused case) with a prescale
    and postscale: each input scaled, folded in rank order, scaled again."""
    shapes = [(768,)] * 200
    per_rank = inputs.all_ranks(shapes, np.float32)
    mine = [a.copy() for a in per_rank[WORLD.rank]]
    with collectively() as blk:
        outs, d = _rode(comm, lambda: comm.allreduce(mine, op="sum", prescale=0.5,
                                                       postscale=3.0))
        for i, out in enumerate(outs):
            ref = scaled(left_fold([r[i] for r in per_rank], "sum", prescale=0.5), 3.0)
            assert out.tobytes() == ref.tobytes(), i
        if ON_ONE_HOST:
            assert d["rode_in_check"] == 1 and d["messages"] == 0, d
        blk.same(outs)


def test_past_the_slot_goes_by_message(comm):
    """A call larger than ride_bytes does not ride: it is a message of its
    own (the cross-memory path from 1 MiB), with the same sum."""
    n = comm.ride_bytes // 4 + 1
    x = np.full(n, WORLD.rank + 1, np.float32)
    with collectively():
        _, d = _rode(comm, lambda: comm.allreduce_(x))
        assert d["rode_in_check"] == 0 and d["messages"] == 1, d
        if ON_ONE_HOST:
            assert comm.stats()["peer_reads"] > 0  # the cross-memory path took it
        assert (x == WORLD.size * (WORLD.size + 1) // 2).all()


def test_mismatch_raises_on_every_rank_and_writes_nothing(comm):
    """Rank 0 passes one element more: every rank raises MismatchError, and
    no rank's tensor changes."""
    n = 100 + (WORLD.rank == 0)
    x = np.full(n, WORLD.rank + 1.0, np.float32)
    before = x.copy()
    with collectively():
        if WORLD.size > 1:
            with pytest.raises(gs.MismatchError, match="count|element|size"):
                comm.allreduce_(x)
            assert x.tobytes() == before.tobytes()
        y = np.ones(5, np.float32)  # still usable, and in step
        comm.allreduce_(y)
        assert (y == WORLD.size).all()


@pytest.mark.skipif(WORLD.size != 2, reason="MPI sums x0 + x1 in that order at 2 ranks")
@pytest.mark.parametrize("n", [1, 33, 5000], ids=lambda n: f"n{n}")
def test_same_bits_without_the_region(comm, without_region, inputs, n):
    """GRADSYNC_SHM_BYTES=0: the call goes through MPI (inside the MPI
    validation message, or as a message) with the same bits."""
    per_rank = inputs.all_ranks([(n,)], np.float32, tag=n)
    a = per_rank[WORLD.rank][0].copy()
    b = a.copy()
    with collectively():
        comm.allreduce_(a)
        without_region.allreduce_(b)
        assert a.tobytes() == b.tobytes()


# ---- jobs of their own: two processes joined by gs.init (no launcher, so a
# killed one does not take the other down with it)

JOB = r"""
import os, signal, sys, threading, time
import numpy as np
import gradsync as gs
from joined import DirStore, deny_memfd_create

rank, store, mode = int(sys.argv[1]), DirStore(sys.argv[2]), sys.argv[3]
if mode == "refused" and rank == 0:
    deny_memfd_create()
gs.init(store, rank=rank, world_size=2)
comm = gs.Communicator(stall_seconds=0)
print("rank %d ride_bytes %d" % (rank, comm.ride_bytes), flush=True)
if mode == "refused":
    for n in (1, 33, 70001):
        x = np.full(n, rank + 1, np.float32)
        comm.allreduce_(x)
        assert (x == 3).all()
    print("rank %d right" % rank, flush=True)
else:  # killed: rank 1 dies while small allreduces run
    x = np.ones(1000, np.float32)
    comm.allreduce_(x)
    gs.set_timeout(60.0)  # far away: only the watch on the peer can end the wait soon
    if rank == 1:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for i in range(10 ** 7):
            x[:] = 1
            comm.allreduce_(x)
            assert (x == 2).all(), "wrong result"
        print("rank %d never raised" % rank, flush=True)
    except gs.Error as e:
        print("rank %d raised %s ranks=%s after %.1f s: %s" % (
            rank, type(e).__name__, getattr(e, "ranks", None), time.monotonic() - t0, e),
            flush=True)
os._exit(0)  # MPI_Finalize would wait for a dead rank
"""


one_rank = pytest.mark.skipif(WORLD.size > 1, reason="starts its own 2-process job")


@one_rank
def test_refused_region_falls_back_to_mpi(tmp_path):
    """Rank 0 may not call memfd_create: no rank gets a region (the same
    answer everywhere), both say why once at debug level, the calls go
    through MPI and are right."""
    procs, outs = run_pair(JOB, tmp_path, "refused", {"GRADSYNC_LOG_LEVEL": "debug"})
    mpi_ride = gs.build_info()["check_payload_bytes"]
    for r in (0, 1):
        assert procs[r].returncode == 0, outs[r][-3000:]
        assert "rank %d ride_bytes %d" % (r, mpi_ride) in outs[r], outs[r][-3000:]
        assert "rank %d right" % r in outs[r], outs[r][-3000:]
    assert outs[0].count("shared region: memfd_create/ftruncate: Operation not permitted") == 1, \
        outs[0][-3000:]
    assert outs[1].count("shared region: rank 0 could not make it") == 1, outs[1][-3000:]


@one_rank
def test_killed_peer_raises_peer_lost_and_leaves_nothing(tmp_path):
    """Rank 1 is SIGKILLed while small allreduces run over the region: rank
    0's wait ends with PeerLostError naming rank 1 (the timeout is 60 s away,
    and the job ends well before it), never a wrong result; /dev/shm holds
    nothing new."""
    before = shm_entries()
    procs, outs = run_pair(JOB, tmp_path, "killed")
    assert procs[1].returncode == -signal.SIGKILL, outs[1][-3000:]
    assert procs[0].returncode == 0, outs[0][-3000:]
    assert "rank 0 raised PeerLostError ranks=(1,)" in outs[0], outs[0][-3000:]
    assert "rank 1 (pid" in outs[0] and "exited" in outs[0], outs[0][-3000:]
    assert shm_entries() - before == set()
