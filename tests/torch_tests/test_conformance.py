"""What torch.distributed documents, and gloo does, beyond the collectives
themselves (issue 26): groups whose ranks are not sorted, monitored_barrier,
group and call timeouts, sequence numbers, receives from any source, sparse
all_reduce, and torch's argument checks. References are torch's documented
semantics (the order of a group's ranks, gloo's monitored_barrier messages)
and values every rank can compute for every other."""
import os
import shutil
import tempfile
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
