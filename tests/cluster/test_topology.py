"""Inside scripts/simcluster: the simulated hosts are what MPI and gradsync
see (local_rank/local_size from MPI_Comm_split_type(SHARED)), ranks on
different hosts exchange their bytes over the shaped data links, the
hierarchical allreduce sends what it should across them, and hierarchical
Adasum groups the ranks by these hosts."""
import os
import socket

import numpy as np
import pytest
from adasum_reference import adasum_vectors
from mpi4py import MPI

import gradsync as gs
from gsutil import bits, collective_assert, collectively, seed_for

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    "SIMCLUSTER_HOSTS" not in os.environ, reason="needs scripts/simcluster")]

WORLD = MPI.COMM_WORLD


def layout():
    """Ranks on each simulated host, as simcluster launched them."""
    return [int(k) for k in os.environ["SIMCLUSTER_RANKS_PER_HOST"].split(",")]


def my_host():
    """(host index, local rank): hydra places ranks host by host in order."""
    r = WORLD.rank
    for h, k in enumerate(layout()):
        if r < k:
            return h, r
        r -= k
    raise AssertionError("rank %d outside the layout %s" % (WORLD.rank, layout()))


def link_bytes(kind="tx"):
    with open("/sys/class/net/%s/statistics/%s_bytes"
              % (os.environ["SIMCLUSTER_DATA_IFACE"], kind)) as f:
        return int(f.read())


def test_local_rank_and_size_are_the_simulated_hosts(comm):
    host, local = my_host()
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    mpi = (node.rank, node.size)
    node.Free()
    names = WORLD.allgather((host, socket.gethostname()))
    expect = (local, layout()[host])
    collective_assert(
        (comm.local_rank, comm.local_size) == expect == mpi,
        "gradsync local %s, MPI_Comm_split_type %s, simulated %s" % (
            (comm.local_rank, comm.local_size), mpi, expect))
    by_host = {}
    for h, name in names:
        by_host.setdefault(h, set()).add(name)
    collective_assert(all(len(v) == 1 for v in by_host.values()) and
                      len({next(iter(v)) for v in by_host.values()}) == len(layout()),
                      "hostnames per host: %s" % by_host)


def _measure(fn, nbytes):
    """Bytes each host's data link sent while fn() ran (read by one rank per
    host, around barriers)."""
    local = my_host()[1]
    WORLD.Barrier()
    b0 = link_bytes() if local == 0 else 0
    WORLD.Barrier()
    out = fn()
    WORLD.Barrier()
    sent = link_bytes() - b0 if local == 0 else None
    per_host = [s for s in WORLD.allgather(sent) if s is not None]
    return out, per_host


def test_ranks_on_other_hosts_talk_over_the_data_links(comm):
    """MPI's netmod really crosses the veth links: an allreduce of N bytes
    makes every host send at least a share of N across its link (nothing
    would if the ranks took a shared-memory shortcut)."""
    h = len(layout())
    if h == 1:
        pytest.skip("one host")
    n = 8 << 20
    out = np.full(n // 4, WORLD.rank, np.float32)
    _, per_host = _measure(lambda: WORLD.Allreduce(MPI.IN_PLACE, out), n)
    ok = all(s >= 0.5 * n * (h - 1) / h for s in per_host)
    collective_assert(ok and np.all(out == sum(range(WORLD.size))),
                      "bytes sent per host for %d bytes: %s" % (n, per_host))


def _with_mode(mode):
    old = os.environ.pop("GRADSYNC_HIERARCHICAL", None)
    os.environ["GRADSYNC_HIERARCHICAL"] = mode
    try:
        return gs.Communicator()
    finally:
        os.environ.pop("GRADSYNC_HIERARCHICAL")
        if old is not None:
            os.environ["GRADSYNC_HIERARCHICAL"] = old


def test_hierarchical_allreduce_crosses_each_link_as_planned():
    """Forced hierarchical, 2 equal hosts: each host's link carries the
    message once (its L ranks each send their 1/L block to the peer host),
    within TCP's overhead; the result is the float64 reference's, the same
    bits on every rank and again on a second call."""
    sizes = layout()
    if len(sizes) != 2 or sizes[0] != sizes[1]:
        pytest.skip("two equal hosts")
    n = 16 << 20
    rng = np.random.default_rng(seed_for("cross", WORLD.rank))
    x = rng.standard_normal(n // 4).astype(np.float32)
    c = _with_mode("1")
    try:
        (first, per_host) = _measure(lambda: c.allreduce(x), n)
        with collectively() as blk:
            again = c.allreduce(x)
            blk.same(again)
        hier = c.stats()["hierarchical"]
    finally:
        c.close()
    ref = WORLD.allreduce(x.astype(np.float64))
    tol = ((WORLD.size + 2) * np.finfo(np.float32).eps
           * WORLD.allreduce(np.abs(x.astype(np.float64))))
    with collectively():
        assert hier == 2, hier
        assert first.tobytes() == again.tobytes()
        assert np.all(np.abs(first - ref) <= tol)
        assert all(0.95 * n <= s <= 1.15 * n + (1 << 16) for s in per_host), per_host


def test_hierarchical_adasum_groups_by_host(comm):
    """adasum="hierarchical" without GRADSYNC_HIERARCHY_SIZE: the mean inside
    each simulated host, Adasum across the hosts' means; where the hosts
    cannot form that tree (unequal, or not powers of two), ValueError on
    every rank and nothing written."""
    assert "GRADSYNC_HIERARCHY_SIZE" not in os.environ
    sizes = layout()
    g, h = sizes[0], len(sizes)
    shapes = [(0,), (1,), (7,), (33, 5), (3000,)]
    per_rank = []
    for r in range(WORLD.size):
        rng = np.random.default_rng(seed_for("hier-adasum", r))
        per_rank.append([rng.standard_normal(s) * (1 + r) for s in shapes])
    mine = [a.copy() for a in per_rank[WORLD.rank]]
    pow2 = lambda k: k & (k - 1) == 0  # noqa: E731
    if len(set(sizes)) != 1 or not pow2(g) or not pow2(h):
        before = [a.copy() for a in mine]
        with collectively():
            with pytest.raises(ValueError, match="hierarchical adasum"):
                comm.allreduce_(mine, "adasum", adasum="hierarchical")
            assert all(bits(a).tobytes() == bits(b).tobytes() for a, b in zip(mine, before))
        return
    with collectively() as blk:
        out = comm.allreduce(mine, "adasum", adasum="hierarchical")
        blk.same(out)
    with collectively():
        for i, s in enumerate(shapes):
            means = [np.mean([per_rank[r][i].reshape(-1) for r in range(k, k + g)], axis=0)
                     for k in range(0, WORLD.size, g)]
            ref = adasum_vectors(means).reshape(s)
            err = np.max(np.abs(out[i] - ref)) if ref.size else 0.0
            assert err <= 1e-12 * (1 + (np.max(np.abs(ref)) if ref.size else 0)), (i, err)


def test_unequal_hosts_stay_flat_and_right():
    """Hosts of unequal sizes: the hierarchical allreduce is never taken (not
    even forced), and the results are right."""
    sizes = layout()
    if len(set(sizes)) == 1:
        pytest.skip("equal hosts")
    x = np.arange(1 << 16, dtype=np.float64) * (WORLD.rank + 1)
    counts = []
    for mode in ("1", "auto"):
        c = _with_mode(mode)
        try:
            with collectively():
                out = c.allreduce(x)
                assert np.array_equal(out, np.arange(1 << 16, dtype=np.float64)
                                      * (WORLD.size * (WORLD.size + 1) // 2))
            counts.append(c.stats()["hierarchical"])
        finally:
            c.close()
    collective_assert(counts == [0, 0], "hierarchical messages %s" % counts)
