"""What torch.distributed documents, and gloo does, beyond the collectives
themselves (issue 26): groups whose ranks are not sorted, monitored_barrier,
group and call timeouts, sequence numbers, receives from any source, sparse
all_reduce, and torch's argument checks. References are torch's documented
semantics (the order of a group's ranks, gloo's monitored_barrier messages)
and values every rank can compute for every other."""
import time
from datetime import timedelta

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradsync as gs  # noqa: E402,F401
from gsutil import collectively  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size


# ---------------------------------------------------------------- unsorted groups

def _check_group_order(ranks):
    """Every rank-ordered collective of new_group(ranks, sort_ranks=False),
    against the order torch documents: group rank i is global rank ranks[i]."""
    group = dist.new_group(ranks=ranks, sort_ranks=False)
    if RANK not in ranks:
        return
    n, me = len(ranks), ranks.index(RANK)
    assert dist.get_process_group_ranks(group) == ranks
    assert dist.get_rank(group) == me and dist.get_world_size(group) == n
    outs = [torch.full((3,), -1.0) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), float(RANK)), group=group)
    assert [int(o[0]) for o in outs] == ranks, "all_gather's order"
    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(RANK)), group=group)
    assert flat[::2].tolist() == [float(r) for r in ranks], "all_gather_into_tensor"
    for root in ranks:  # a global rank, as torch's API takes it
        b = torch.tensor([float(RANK)])
        dist.broadcast(b, src=root, group=group)
        assert b.item() == root, f"broadcast from global rank {root}"
        r = torch.tensor([float(RANK + 1)])
        dist.reduce(r, dst=root, group=group)
        if RANK == root:
            assert r.item() == sum(x + 1 for x in ranks), f"reduce to {root}"
        g = [torch.zeros(1) for _ in range(n)] if RANK == root else None
        dist.gather(torch.tensor([float(RANK)]), g, dst=root, group=group)
        if RANK == root:
            assert [int(t.item()) for t in g] == ranks, f"gather at {root}"
        s = torch.zeros(1)
        pieces = [torch.tensor([100.0 * root + r]) for r in ranks] if RANK == root else None
        dist.scatter(s, pieces, src=root, group=group)
        assert s.item() == 100.0 * root + RANK, f"scatter from {root}"
    # reduce_scatter: group rank i gets block i, the sum of what every
    # member put there (member r puts 10 * r + i into block i)
    out = torch.zeros(1)
    dist.reduce_scatter(out, [torch.tensor([10.0 * RANK + i]) for i in range(n)], group=group)
    assert out.item() == sum(10.0 * r + me for r in ranks), "reduce_scatter's blocks"
    # all_to_all_single: block i goes to group rank i
    a2a = torch.zeros(n)
    dist.all_to_all_single(a2a, torch.tensor([100.0 * RANK + i for i in range(n)]), group=group)
    assert a2a.tolist() == [100.0 * r + me for r in ranks], "all_to_all_single's blocks"
    # send/recv name global ranks: the next in the list order
    nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
    got = torch.zeros(1)
    req = dist.irecv(got, src=prev, group=group, tag=5)
    dist.isend(torch.tensor([float(RANK)]), dst=nxt, group=group, tag=5).wait()
    req.wait()
    assert got.item() == prev, "p2p between global ranks of the group"


def test_new_group_unsorted_whole_world(torch_pg):
    """new_group(ranks=[P-1, ..., 0], sort_ranks=False): the group is in
    the given order, not MPI's."""
    with collectively():
        _check_group_order(list(range(SIZE))[::-1])


def test_new_group_unsorted_subset(torch_pg):
    """A permuted subset (at 3 ranks: [2, 0], rank 1 outside)."""
    if SIZE < 3:
        pytest.skip("a proper permuted subset needs three ranks")
    with collectively():
        _check_group_order([SIZE - 1] + list(range(SIZE - 2)))


# ---------------------------------------------------------------- monitored_barrier

def _arrive_tag(group):
    from gradsync.torch.distributed import _monitored
    return _monitored.tags(group.comm)[0]


def test_monitored_barrier_passes_when_all_arrive(torch_pg):
    with collectively():
        assert dist.monitored_barrier(timeout=timedelta(seconds=120)) is None
    with collectively():
        dist.monitored_barrier(timeout=timedelta(seconds=120), wait_all_ranks=True)
    group = dist.new_group(list(range(SIZE))[::-1], sort_ranks=False)  # rank 0 is the last
    with collectively():
        group.monitored_barrier(timedelta(seconds=120))
        dist.all_reduce(torch.ones(1), group=group)


def test_monitored_barrier_names_the_rank_that_never_arrives(torch_pg):
    """The last rank never calls; the others do. Rank 0 starts only once it
    sees every other caller's arrival (order, not time), waits its 300 ms
    for the last rank, and names it; the ranks that arrived are told rank 0
    failed. The group stays usable: everyone's next barrier passes."""
    if SIZE < 2:
        pytest.skip("needs a rank that does not arrive")
    missing = SIZE - 1
    arrive = _arrive_tag(torch_pg)
    with collectively():
        if RANK == 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                    torch_pg.comm.probe(r, tag=arrive) is None for r in range(1, missing)):
                time.sleep(0.001)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=f"Rank {missing} failed to pass "
                                                   "monitoredBarrier in 300 ms"):
                dist.monitored_barrier(timeout=timedelta(seconds=0.3))
            assert time.monotonic() - t0 >= 0.29  # its own timeout, not the group's 30 min
        elif RANK != missing:
            with pytest.raises(RuntimeError, match=f"Rank {RANK} successfully reached "
                               "monitoredBarrier, but received errors while waiting for "
                               "send/recv from rank 0"):
                dist.monitored_barrier(timeout=timedelta(seconds=0.3))
    with collectively():  # wait_all_ranks: only rank 0 calls, every other rank is named
        if RANK == 0:
            others = ", ".join(str(r) for r in range(1, SIZE))
            with pytest.raises(RuntimeError, match=f"Ranks {others} failed to pass "
                                                   "monitoredBarrier"):
                dist.monitored_barrier(timeout=timedelta(seconds=0.1), wait_all_ranks=True)
            with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier after "
                                                   "0 ms"):
                torch_pg.monitored_barrier(timedelta(seconds=0))
    with collectively():
        dist.monitored_barrier(timeout=timedelta(seconds=120))
    with collectively():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == SIZE


def test_monitored_barrier_on_a_subgroup(torch_pg):
    """torch's own case: group [0, 1], rank 1 never calls; rank 0 names it;
    ranks outside the group pass through."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    sub = dist.new_group([0, 1])
    with collectively():
        if RANK == 0:
            with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier"):
                dist.monitored_barrier(sub, timeout=timedelta(seconds=0.1))
        elif RANK > 1:
            dist.monitored_barrier(sub, timeout=timedelta(seconds=0.1))


# ---------------------------------------------------------------- timeouts

ABANDONED = ("WARNING: freeing a communicator abandoned after a collective took longer than "
             "its timeout")


def _free_timed_out(group, capfd):
    """Frees the communicator under a group a timeout left unusable, checking
    gradsync's warning that it keeps its MPI resources (freed at exit, the
    warning would come after pytest's report, unexplained)."""
    capfd.readouterr()
    group.comm.close()
    assert ABANDONED in capfd.readouterr().err


def test_group_timeout_ends_a_barrier_one_rank_never_joins(torch_pg, capfd):
    """new_group(timeout=1s): rank 0's barrier on it ends after the group's
    second (not the default group's 30 minutes) with torch's words."""
    if SIZE < 2:
        pytest.skip("needs a rank that does not join")
    group = dist.new_group(list(range(SIZE)), timeout=timedelta(seconds=1))
    with collectively():
        if RANK == 0:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=" Timed out waiting 1000ms ") as err:
                dist.barrier(group=group)
            assert time.monotonic() - t0 >= 0.95
            assert isinstance(err.value, TimeoutError) and isinstance(err.value, gs.TimeoutError)
            assert "timeout" in str(err.value)
            with pytest.raises(gs.Error, match="unusable"):  # as gradsync leaves it
                dist.all_reduce(torch.ones(1), group=group)
            _free_timed_out(group, capfd)


def test_call_timeout_overrides_the_groups(torch_pg, capfd):
    """barrier(timeout=) on a group whose own timeout is 300 s: the call's
    limit ends it; a call that completes leaves the group's limit in place."""
    if SIZE < 2:
        pytest.skip("needs a rank that does not join")
    group = dist.new_group(list(range(SIZE)), timeout=timedelta(seconds=300))
    with collectively():
        dist.barrier(group=group, timeout=timedelta(seconds=120))
        assert group.comm.timeout == 300
    lonely = dist.new_group(list(range(SIZE)), timeout=timedelta(seconds=300))
    with collectively():
        if RANK == 0:
            with pytest.raises(RuntimeError, match="Timed out waiting 400ms"):
                dist.barrier(group=lonely, timeout=timedelta(seconds=0.4))
            assert lonely.comm.timeout == 300
            _free_timed_out(lonely, capfd)


# ---------------------------------------------------------------- sequence numbers

def test_sequence_numbers_count_collectives_alike_on_every_rank(torch_pg):
    group = dist.new_group(list(range(SIZE)))
    with collectively() as blk:
        group._set_sequence_number_for_group()
        start = group._get_sequence_number_for_group()
        blk.same(start)
    for _ in range(3):
        dist.all_reduce(torch.ones(2), group=group)
        dist.all_reduce(torch.ones(2), group=group, async_op=True).wait()
        dist.barrier(group=group)
    dist.broadcast(torch.ones(2), src=0, group=group)
    if SIZE > 1:  # point to point does not count
        peer = (RANK + 1) % SIZE
        req = dist.irecv(torch.zeros(1), src=(RANK - 1) % SIZE, group=group, tag=1)
        dist.send(torch.zeros(1), dst=peer, group=group, tag=1)
        req.wait()
    with collectively() as blk:
        now = group._get_sequence_number_for_group()
        assert now == start + 10, (start, now)
        blk.same(now)


# ---------------------------------------------------------------- any source

def test_recv_from_any_source_names_the_sender(torch_pg):
    """Every rank but one sends to it; it receives without naming senders
    (recv and irecv) and gets each rank's tensor once, from the global rank
    torch returns. On a reversed group the receiver is group rank 0."""
    for ranks, sort in ((list(range(SIZE)), True), (list(range(SIZE))[::-1], False)):
        group = dist.new_group(ranks, sort_ranks=sort)
        root = ranks[0]
        with collectively():
            if RANK != root:
                dist.send(torch.full((3,), float(RANK)), dst=root, group=group, tag=6)
            else:
                seen = []
                for k in range(SIZE - 1):
                    t = torch.zeros(3)
                    if k % 2 == 0:
                        src = dist.recv(t, group=group, tag=6)
                    else:
                        work = dist.irecv(t, group=group, tag=6)
                        work.wait()
                        src = dist.get_global_rank(group, work._source_rank())
                    assert torch.equal(t, torch.full((3,), float(src))), (src, t)
                    seen.append(src)
                assert sorted(seen) == [r for r in range(SIZE) if r != root]


# ---------------------------------------------------------------- sparse, argument checks

def _sparse_input(rank, kind):
    """Rank ``rank``'s sparse tensor (any rank can make any rank's)."""
    if kind == "rows":  # sparse dim 1, dense rows of 3; rank 2 holds nothing
        rows = [] if rank == 2 else [rank % 5, (rank + 2) % 5, 4]
        vals = [[10.0 * rank + j + 3 * i for j in range(3)] for i in range(len(rows))]
        return torch.sparse_coo_tensor(torch.tensor([rows], dtype=torch.int64).reshape(1, -1),
                                       torch.tensor(vals).reshape(-1, 3), (5, 3))
    idx = torch.tensor([[rank % 4, 1, 3], [0, rank % 2, 2]])
    return torch.sparse_coo_tensor(idx, torch.tensor([rank + 1, 7, -rank], dtype=torch.int64),
                                   (4, 3))


@pytest.mark.parametrize("kind", ["rows", "elements"])
def test_sparse_all_reduce_sums_as_gloo(kind, torch_pg):
    x = _sparse_input(RANK, kind)
    expected = sum(_sparse_input(r, kind).to_dense() for r in range(SIZE))
    with collectively() as blk:
        dist.all_reduce(x)
        assert x.is_sparse
        assert torch.equal(x.to_dense(), expected), (x.to_dense(), expected)
        blk.same(x.coalesce().values())
    with collectively():
        with pytest.raises(NotImplementedError, match="SUM"):
            dist.all_reduce(_sparse_input(RANK, kind), op=dist.ReduceOp.MAX)


def test_all_to_all_single_refuses_a_non_contiguous_input(torch_pg):
    x = torch.arange(4.0 * SIZE).reshape(2, 2 * SIZE).t()  # (2P, 2), not contiguous
    with collectively():
        with pytest.raises(ValueError, match="contiguous"):
            dist.all_to_all_single(torch.empty(2 * SIZE, 2), x)
        out = torch.empty(2, 2 * SIZE).t()  # a non-contiguous output is fine, as with gloo
        dist.all_to_all_single(out, x.contiguous())
        mine = x.contiguous()[2 * RANK:2 * RANK + 2]  # every rank sends the same x
        expected = torch.cat([mine] * SIZE)
        assert torch.equal(out, expected)
