"""The hierarchical allreduce (docs/CLUSTER.md section 4, src/transport/mpi/hierarchical.c):
reduce-scatter inside each host, allreduce across hosts, allgather inside the
host, against float64 (int64) references, bitwise identical on every rank and
from run to run, and chosen where it should be.

On one machine the hosts are simulated with GRADSYNC_HIERARCHY_SIZE (groups of
consecutive ranks); inside scripts/simcluster the hosts MPI reports are used
as well."""
import os
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    ALL_DTYPES,
    BF16,
    OPS,
    bits,
    check_reduction,
    collective_assert,
    collectively,
    is_int,
)

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
# 0, 1, odd, a few fused, and tensors larger than the 4 KiB fusion threshold
SHAPES = [(0,), (1,), (7,), (33, 5), (1001,), (5003,), (2,), (300, 3)]
KIND = {"sum": "normal", "average": "normal", "min": "full", "max": "full", "prod": "prod"}


def mpi_hosts():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    sizes = WORLD.allgather(node.size)
    node.Free()
    return sizes


def host_layouts():
    """(GRADSYNC_HIERARCHY_SIZE or None for MPI's hosts, ranks per host):
    MPI's own hosts when they are equal, and every other group size that
    divides the ranks."""
    p = WORLD.size
    out = []
    sizes = mpi_hosts()
    if len(set(sizes)) == 1:
        out.append((None, sizes[0]))
    out += [(g, g) for g in range(1, p + 1) if p % g == 0 and (g, g) != (p, sizes[0])]
    return out


def main_layout():
    """The layout the full op-by-dtype matrix runs on: MPI's hosts when there
    are several, else two or more groups of several ranks where the rank
    count allows (one group per rank otherwise)."""
    sizes = mpi_hosts()
    if len(set(sizes)) == 1 and len(sizes) > sizes[0]:
        return [(None, sizes[0])]
    p = WORLD.size
    g = next((g for g in range(2, p) if p % g == 0), 1)
    return [(g, g)]


@contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def communicator(mode, group, **kw):
    """A Communicator made with GRADSYNC_HIERARCHICAL=mode; the group knob is
    read at each call, so callers keep env(GRADSYNC_HIERARCHY_SIZE=group) on."""
    with env(GRADSYNC_HIERARCHICAL=mode):
        return gs.Communicator(**kw)


def layout_id(layout):
    return "mpi-hosts" if layout[0] is None else "groups-of-%d" % layout[0]


LAYOUTS = host_layouts()


def _matrix():
    for op in OPS:
        for dt in ALL_DTYPES:
            if op == "average" and is_int(dt):
                continue
            yield pytest.param(op, dt, id="%s-%s" % (op, dt.name))


@pytest.mark.parametrize("layout", main_layout(), ids=layout_id)
@pytest.mark.parametrize("op,dtype", list(_matrix()))
def test_every_op_and_dtype(op, dtype, layout, inputs):
    """Forced hierarchical: out of place and in place against the reference,
    the same bits both ways and on every rank, every message hierarchical."""
    group, _ = layout
    per_rank = inputs.all_ranks(SHAPES, dtype, KIND[op])
    mine = [a.copy() for a in per_rank[WORLD.rank]]
    with env(GRADSYNC_HIERARCHY_SIZE=group):
        c = communicator("1", group, fusion_threshold=4096)
        before = c.stats()
        try:
            with collectively(what="out of place") as blk:
                out = c.allreduce(mine, op)
                blk.same(out)
            with collectively(what="in place"):
                c.allreduce_(mine, op)
            after = c.stats()
        finally:
            c.close()
    with collectively(what="values"):
        check_reduction(out, per_rank, op, SHAPES, dtype)
        for a, b in zip(out, mine):
            assert bits(a).tobytes() == bits(b).tobytes(), "in place differs from out of place"
        if WORLD.size > 1:
            sent = after["messages"] - before["messages"]
            assert after["hierarchical"] - before["hierarchical"] == sent > 0, (before, after)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64])
def test_scales_and_average(dtype, layout, inputs):
    """prescale, postscale and average keep their meaning (applied by the
    fusion engine around the hierarchical exchange)."""
    group, _ = layout
    shapes = [(5003,), (1,), (64, 3)]
    per_rank = inputs.all_ranks(shapes, dtype, "normal")
    with env(GRADSYNC_HIERARCHY_SIZE=group):
        c = communicator("1", group)
        try:
            with collectively() as blk:
                avg = c.allreduce(per_rank[WORLD.rank], "average", prescale=0.5, postscale=3.0)
                blk.same(avg)
            with collectively() as blk:
                s = c.allreduce(per_rank[WORLD.rank], "sum", prescale=0.25)
                blk.same(s)
        finally:
            c.close()
    with collectively():
        check_reduction(avg, per_rank, "average", shapes, dtype, prescale=0.5, postscale=3.0)
        check_reduction(s, per_rank, "sum", shapes, dtype, prescale=0.25)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_deterministic_and_half_precision(layout, inputs):
    """The same inputs give the same bits call after call and on every rank;
    float16 near the end of its integer range rounds once per step (each step
    adds in float32 and rounds to nearest even)."""
    group, _ = layout
    p = WORLD.size
    rng = inputs.rng(WORLD.rank, "det")
    x = (rng.standard_normal(100003) * 10.0 ** rng.integers(-4, 4, 100003)).astype(np.float32)
    # 2048 at element 0 on rank 0, 1.0 everywhere else: float16's spacing
    # there is 2, so each step that adds 1 to it rounds (ties to even)
    h = np.full(4097, 1.0, np.float16)
    if WORLD.rank == 0:
        h[0] = 2048.0
    with env(GRADSYNC_HIERARCHY_SIZE=group):
        c = communicator("1", group)
        try:
            outs = []
            for _ in range(3):
                with collectively() as blk:
                    outs.append(c.allreduce(x))
                    blk.same(outs[-1])
            with collectively() as blk:
                hs = c.allreduce(h)
                blk.same(hs)
        finally:
            c.close()
    ref = WORLD.allreduce(x.astype(np.float64))
    with collectively():
        assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()
        tol = (p + 2) * np.finfo(np.float32).eps * WORLD.allreduce(np.abs(x.astype(np.float64)))
        assert np.all(np.abs(outs[0] - ref) <= tol)
        assert np.all(hs[1:] == p)
        # at most half a spacing (1.0) lost per step, p - 1 steps
        assert 2048 <= float(hs[0]) and abs(float(hs[0]) - (2048 + p - 1)) <= max(p - 1, 0)


def test_nan_and_integer_wrap_survive(inputs):
    """NaN on one rank survives sum, min and max; integer sums wrap as flat."""
    p = WORLD.size
    g = p // 2 if p % 2 == 0 and p > 2 else p
    x = np.arange(1000, dtype=np.float32)
    if WORLD.rank == p - 1:
        x[[3, 500, 999]] = np.nan
    big = np.full(2000, np.iinfo(np.int32).max // 2 + 7, np.int32)
    with env(GRADSYNC_HIERARCHY_SIZE=g):
        c = communicator("1", g)
        flat = communicator("0", g)
        try:
            with collectively():
                res = {op: c.allreduce(x, op) for op in ("sum", "min", "max")}
            with collectively():
                wrapped = c.allreduce(big)
            with collectively():
                wrapped_flat = flat.allreduce(big)
        finally:
            c.close()
            flat.close()
    with collectively():
        for op, r in res.items():
            assert np.all(np.isnan(r[[3, 500, 999]])), op
            assert not np.any(np.isnan(np.delete(r, [3, 500, 999]))), op
        expect = (big.astype(np.int64) * p).astype(np.int32)  # two's complement wrap
        assert np.array_equal(wrapped, expect) and np.array_equal(wrapped_flat, expect)


def test_auto_choice():
    """Unset (auto): hierarchical exactly for messages of 8 MiB and more when
    there are several hosts of several ranks; 0 never; 1 always."""
    p = WORLD.size
    groups = [g for g in range(2, p) if p % g == 0]
    small = np.ones((8 << 20) // 4 - 1, np.float32)  # 4 bytes short of 8 MiB
    large = np.ones((8 << 20) // 4, np.float32)
    for g in groups + [None]:
        with env(GRADSYNC_HIERARCHY_SIZE=g):
            sizes = mpi_hosts() if g is None else [g] * p
            spans = len(set(sizes)) == 1 and 1 < sizes[0] < p
            got = {}
            for mode in (None, "0", "1"):
                c = communicator(mode, g)
                try:
                    counts = []
                    for t in (small, large):
                        before = c.stats()["hierarchical"]
                        with collectively():
                            out = c.allreduce(t)
                            assert np.all(out == p)
                        counts.append(c.stats()["hierarchical"] - before)
                    got[mode] = counts
                finally:
                    c.close()
            expect = {None: [0, 1 if spans else 0], "0": [0, 0],
                      "1": [1, 1] if p > 1 and len(set(sizes)) == 1 else [0, 0]}
            collective_assert(got == expect, "group %s: %s, expected %s" % (g, got, expect))


def test_group_that_does_not_divide_falls_back_to_flat():
    """GRADSYNC_HIERARCHICAL=1 where the hosts cannot be equal: flat, right."""
    p = WORLD.size
    bad = [g for g in range(2, p) if p % g]
    if not bad:
        pytest.skip("every group size divides %d ranks" % p)
    x = np.arange(70000, dtype=np.float64) + WORLD.rank
    with env(GRADSYNC_HIERARCHY_SIZE=bad[0]):
        c = communicator("1", bad[0])
        try:
            with collectively():
                out = c.allreduce(x)
            n = c.stats()["hierarchical"]
        finally:
            c.close()
    expect = np.arange(70000, dtype=np.float64) * p + p * (p - 1) / 2
    collective_assert(n == 0 and np.array_equal(out, expect), "hierarchical %d" % n)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_host_stages_read_the_peers(dtype, inputs):
    """Forced hierarchical, groups of two or more ranks: a message of two
    and a half 4 MiB segments has its host stages (reduce-scatter,
    allgather) read the peers' memory (transport/mpi/cma.c; comm.stats()'s
    peer_reads count them) while the crossing is in flight: against the
    reference, in place and out of place, and with two ranks a host the
    same bits as the host stages through MPI (both fold x0 + x1)."""
    group, per_host = main_layout()[0]
    shapes = [(5 * (1 << 21) // np.dtype(dtype).itemsize,), (1001,)]  # 10 MiB: 2.5 segments
    per_rank = inputs.all_ranks(shapes, dtype, "normal", tag="cma")
    outs = {}
    with env(GRADSYNC_HIERARCHY_SIZE=group):
        for cma_bytes in ("1", "0"):
            with env(GRADSYNC_CMA_BYTES=cma_bytes):
                c = communicator("1", group)
            try:
                before = c.stats()["peer_reads"]
                mine = [a.copy() for a in per_rank[WORLD.rank]]
                with collectively(what=f"out of place, GRADSYNC_CMA_BYTES={cma_bytes}") as blk:
                    out = c.allreduce(mine)
                    blk.same(out)
                with collectively(what=f"in place, GRADSYNC_CMA_BYTES={cma_bytes}"):
                    c.allreduce_(mine)
                    assert all(bits(a).tobytes() == bits(b).tobytes() for a, b in zip(out, mine))
                outs[cma_bytes] = (out, c.stats()["peer_reads"] - before)
            finally:
                c.close()
    with collectively():
        check_reduction(outs["1"][0], per_rank, "sum", shapes, dtype)
        direct = per_host > 1 and WORLD.size > per_host
        assert (outs["1"][1] > 0) == direct and outs["0"][1] == 0, (outs["1"][1], outs["0"][1])
        if per_host == 2:
            for a, b in zip(outs["1"][0], outs["0"][0]):
                assert bits(a).tobytes() == bits(b).tobytes(), "direct and MPI host stages differ"
