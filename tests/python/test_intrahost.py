"""The allreduce inside one host that reads the peers' memory (issue 33,
src/transport/mpi/cma.c): results against a fold in rank order computed here in
the dtype, bit for bit; the same bits as gradsync's MPI path at 2 ranks
(where the two sum in the same order); the same bits on every rank; the
path really taken (comm.stats()["peer_reads"]); falling back to MPI where
the OS refuses the reads (a seccomp filter, as a container without CMA
has) or GRADSYNC_CMA_BYTES=0 turns them off; a peer killed in the middle
of a reduction leaves the others with an error, never a result; nothing
left in /dev/shm."""
import signal

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gradsync.bench.data import cut_at_shards
from gsutil import (
    ALL_DTYPES,
    BF16,
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
THRESHOLD = 4096  # fusion threshold: lists go out in several messages


def make_comm(cma_bytes, **kw):
    """A communicator made with GRADSYNC_CMA_BYTES=cma_bytes (read when a
    communicator is made)."""
    with environment("GRADSYNC_CMA_BYTES", cma_bytes):
        return gs.Communicator(MPI.COMM_WORLD, **kw)


@pytest.fixture(scope="module")
def direct():
    c = make_comm(1, fusion_threshold=THRESHOLD)  # every message reads the peers
    yield c
    c.close()


@pytest.fixture(scope="module")
def through_mpi():
    c = make_comm(0, fusion_threshold=THRESHOLD)
    yield c
    c.close()


# sizes 0, 1, odd, and past the fusion threshold (several messages)
SHAPES = [(0,), (1,), (17,), (3, 5), (5000,), (70001,)]
CASES = [(dt, op) for dt in ALL_DTYPES for op in ("sum", "min", "max", "prod")
         if not (op == "prod" and is_int(dt))]
CASES += [(np.dtype(np.float32), "average"), (np.dtype(np.float64), "average")]


@pytest.mark.parametrize("dt,op", CASES, ids=[f"{d.name}-{o}" for d, o in CASES])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_rank_order_fold_bit_for_bit(direct, inputs, dt, op, in_place):
    per_rank = inputs.all_ranks(SHAPES, dt, kind="small" if is_int(dt) else "normal")
    mine = [a.copy() for a in per_rank[WORLD.rank]]
    before = direct.stats()["peer_reads"]
    with collectively(what=f"{dt.name} {op}") as blk:
        if in_place:
            direct.allreduce_(mine, op=op)
            outs = mine
        else:
            outs = direct.allreduce(mine, op=op)
            for a, b in zip(mine, per_rank[WORLD.rank]):  # inputs untouched
                assert a.tobytes() == b.tobytes()
        for i, out in enumerate(outs):
            ref = left_fold([r[i] for r in per_rank], op)
            assert out.dtype == dt and out.shape == ref.shape
            assert out.tobytes() == ref.tobytes(), (i, out.ravel()[:5], ref.ravel()[:5])
        if WORLD.size > 1:  # one call, not one per message: one dtype here
            assert direct.stats()["peer_reads"] == before + 1
        blk.same(outs)


def test_mixed_dtypes_one_call_per_dtype(direct, inputs):
    dts = [np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.float32), BF16,
           np.dtype(np.float64), np.dtype(np.int32)]
    shapes = [(40000,), (3,), (999,), (2049,), (1,), (12345,)]
    per_rank = [inputs.arrays(r, shapes, dts, kind="small") for r in range(WORLD.size)]
    mine = [a.copy() for a in per_rank[WORLD.rank]]
    before = direct.stats()["peer_reads"]
    with collectively() as blk:
        direct.allreduce_(mine)
        for i, out in enumerate(mine):
            assert out.tobytes() == left_fold([r[i] for r in per_rank], "sum").tobytes(), i
        if WORLD.size > 1:
            assert direct.stats()["peer_reads"] == before + 4  # float32, int32, bf16, float64
        blk.same(mine)


@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.float16), BF16,
                                np.dtype(np.float64)], ids=lambda d: d.name)
def test_same_bits_as_the_mpi_path_at_two_ranks(direct, through_mpi, inputs, dt):
    """At 2 ranks MPI computes x0 + x1 too: the two paths agree bit for bit,
    in place, out of place, averaged and postscaled."""
    if WORLD.size != 2:
        pytest.skip("the fold's order is MPI's at 2 ranks only")
    mine = inputs.arrays(WORLD.rank, SHAPES + [(300001,)], dt)
    with collectively() as blk:
        for kw in ({}, {"op": "average"}, {"postscale": 0.37}, {"prescale": 0.5}):
            a, b = [x.copy() for x in mine], [x.copy() for x in mine]
            direct.allreduce_(a, **kw)
            through_mpi.allreduce_(b, **kw)
            assert [x.tobytes() for x in a] == [x.tobytes() for x in b], kw
            assert [x.tobytes() for x in direct.allreduce(mine, **kw)] == \
                [x.tobytes() for x in b], kw
        assert through_mpi.stats()["peer_reads"] == 0
        blk.same(a)


def test_default_threshold_and_prescale(inputs):
    """A default communicator reads the peers from 1 MiB (a 4 MiB list goes
    that way, a 64 KiB one does not); with a prescale, each input is scaled
    as it is read, in one call still."""
    c = gs.Communicator(MPI.COMM_WORLD)
    try:
        big = inputs.all_ranks([(1 << 19,), (1 << 19,), (7,)], np.float32)
        small = inputs.all_ranks([(1 << 14,)], np.float32, tag="small")
        with collectively():
            for per_rank, reads in ((big, 1), (small, 0)):
                mine = [a.copy() for a in per_rank[WORLD.rank]]
                before = c.stats()["peer_reads"]
                c.allreduce_(mine)
                for i, out in enumerate(mine):
                    assert out.tobytes() == left_fold([r[i] for r in per_rank], "sum").tobytes() \
                        or WORLD.size > 2 and not reads
                got = c.stats()["peer_reads"] - before
                assert got == (reads if WORLD.size > 1 else 0), got
            before = c.stats()["peer_reads"]
            mine = [a.copy() for a in big[WORLD.rank]]
            c.allreduce_(mine, prescale=0.3, postscale=3.0)
            assert c.stats()["peer_reads"] - before == (1 if WORLD.size > 1 else 0)
            for i, out in enumerate(mine):
                ref = scaled(left_fold([r[i] for r in big], "sum", prescale=0.3), 3.0)
                assert out.tobytes() == ref.tobytes(), i
    finally:
        c.close()


def test_mismatched_threshold_raises_on_every_rank():
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    c = make_comm(4096 if WORLD.rank == WORLD.size - 1 else 1 << 20)
    try:
        with collectively():
            with pytest.raises(gs.MismatchError, match="GRADSYNC_CMA_BYTES"):
                c.allreduce_(np.ones(1 << 18, np.float32))
    finally:
        c.close()


# ---- jobs of their own: two processes joined by gs.init (no launcher, so a
# killed one does not take the other down with it)

JOB = r"""
import os, signal, sys, threading
import numpy as np
import gradsync as gs
from joined import DirStore, deny_process_vm_readv

rank, store, mode = int(sys.argv[1]), DirStore(sys.argv[2]), sys.argv[3]
if mode == "refused":  # both: UCX (under gs.init) must see the same on each
    deny_process_vm_readv()
gs.init(store, rank=rank, world_size=2)
comm = gs.Communicator(stall_seconds=0)
if mode == "refused":
    for _ in range(2):
        x = np.full(1 << 20, rank + 1, np.float32)
        comm.allreduce_(x)
        assert (x == 3).all()
    print("rank %d peer_reads %d" % (rank, comm.stats()["peer_reads"]), flush=True)
else:  # killed: rank 1 dies while the large allreduces run
    x = np.ones(1 << 25, np.float32)  # 128 MiB: tens of milliseconds a call
    comm.allreduce_(x)
    print("rank %d peer_reads %d" % (rank, comm.stats()["peer_reads"]), flush=True)
    gs.set_timeout(5.0)
    if rank == 1:
        threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        for i in range(200):
            x[:] = 1
            comm.allreduce_(x)
            assert (x == 2).all(), "wrong result"
        print("rank %d never raised" % rank, flush=True)
    except gs.Error as e:
        print("rank %d raised %s: %s" % (rank, type(e).__name__, e), flush=True)
os._exit(0)  # MPI_Finalize would wait for a dead rank
"""


one_rank = pytest.mark.skipif(WORLD.size > 1, reason="starts its own 2-process job")


@one_rank
def test_refused_reads_fall_back_to_mpi(tmp_path):
    """Neither process may call process_vm_readv (a seccomp filter, as in a
    container without CMA): the probe turns the reads off, the results are
    right, and each rank says why once at debug level."""
    procs, outs = run_pair(JOB, tmp_path, "refused", {"GRADSYNC_LOG_LEVEL": "debug"})
    for r in (0, 1):
        assert procs[r].returncode == 0, outs[r][-3000:]
        assert "rank %d peer_reads 0" % r in outs[r], outs[r][-3000:]
    for r in (0, 1):
        said = "cannot read rank %d's memory (process_vm_readv: Operation not permitted)" % (1 - r)
        assert outs[r].count(said) == 1, outs[r][-3000:]


@one_rank
def test_killed_peer_is_an_error_and_leaves_no_segment(tmp_path):
    """Rank 1 is SIGKILLed while 128 MiB allreduces run: rank 0 raises
    PeerLostError (the communicator's watch on its peers' processes ends
    the MPI waits of the path as well as the shared region's, long before
    the 5 s timeout), never returns a result of the dead rank's memory as a
    success; /dev/shm holds nothing new afterwards."""
    before = shm_entries()
    procs, outs = run_pair(JOB, tmp_path, "killed")
    assert procs[1].returncode == -signal.SIGKILL, outs[1][-3000:]
    assert "rank 1 peer_reads 1" in outs[1], outs[1][-3000:]
    assert procs[0].returncode == 0, outs[0][-3000:]
    assert "rank 0 peer_reads 1" in outs[0], outs[0][-3000:]
    assert "rank 0 raised PeerLostError" in outs[0], outs[0][-3000:]
    assert "never raised" not in outs[0] and "wrong result" not in outs[0], outs[0][-3000:]
    assert shm_entries() - before == set()


def _reads(c, fn):
    before = c.stats()["peer_reads"]
    out = fn()
    return out, c.stats()["peer_reads"] - before


@pytest.mark.parametrize("rows", [0, 1, 7, 5000], ids=lambda r: f"rows{r}")
def test_allgather_and_reduce_scatter_read_the_peers(direct, through_mpi, inputs, rows):
    """allgather (rows differing by rank) gives MPI's result exactly;
    reduce_scatter gives each rank its block of the rank-order fold."""
    p, me = WORLD.size, WORLD.rank
    shapes = [(rows + r, 3) for r in range(p)]
    per_rank = [inputs.arrays(r, [shapes[r]], np.float32)[0] for r in range(p)]
    n = p * (rows + 2)
    full = [inputs.arrays(r, [(n, 5)], np.float32, tag="rs")[0] for r in range(p)]
    with collectively() as blk:
        gathered, reads = _reads(direct, lambda: direct.allgather(per_rank[me]))
        got = gathered
        assert got.tobytes() == np.concatenate(per_rank).tobytes()
        assert got.tobytes() == through_mpi.allgather(per_rank[me]).tobytes()
        assert reads == (1 if p > 1 else 0), reads
        got, reads = _reads(direct, lambda: direct.reduce_scatter(full[me]))
        block = n // p
        assert got.tobytes() == left_fold(full, "sum")[me * block:(me + 1) * block].tobytes()
        assert reads == (1 if p > 1 else 0), reads
        if p == 2:
            assert got.tobytes() == through_mpi.reduce_scatter(full[me]).tobytes()
        blk.same([gathered])


def test_shard_collectives_read_the_peers(direct, inputs):
    """The ZeRO shard collectives ride on the same transport calls: the
    owner's block of the fold in place, then every rank every owner's."""
    p, me = WORLD.size, WORLD.rank
    # sizes 1, odd and larger, cut where they cross an owner's range
    shapes = [(n,) for n in cut_at_shards([1000, 1, 4097, 33, 20000], p)]
    per_rank = inputs.all_ranks(shapes, np.float32)
    mine = [a.copy() for a in per_rank[me]]
    with collectively() as blk:
        _, reads = _reads(direct, lambda: direct.reduce_scatter_shards_(mine))
        assert reads >= (1 if p > 1 else 0), reads
        _, reads = _reads(direct, lambda: direct.allgather_shards_(mine))
        assert reads >= (1 if p > 1 else 0), reads
        for i, out in enumerate(mine):
            assert out.tobytes() == left_fold([r[i] for r in per_rank], "sum").tobytes(), i
        blk.same(mine)
