"""Hierarchical Adasum (docs/GUIDE.md section 5): the mean inside each group of L
ranks, then Adasum across the groups' means, against a float64 reference.

On one node the groups are set with GRADSYNC_HIERARCHY_SIZE (the ranks of a
node otherwise, which here is every rank: then the result is the mean)."""
import os
from contextlib import contextmanager

import numpy as np
import pytest
from adasum_reference import adasum_vectors

import gradsync as gs
from gsutil import bits, collectively, seed_for

pytestmark = pytest.mark.mpi


@contextmanager
def group_size(n):
    old = os.environ.get("GRADSYNC_HIERARCHY_SIZE")
    if n is None:
        os.environ.pop("GRADSYNC_HIERARCHY_SIZE", None)
    else:
        os.environ["GRADSYNC_HIERARCHY_SIZE"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GRADSYNC_HIERARCHY_SIZE", None)
        else:
            os.environ["GRADSYNC_HIERARCHY_SIZE"] = old


def power_of_two(n):
    return n > 0 and n & (n - 1) == 0


def valid_groups(p):
    return [g for g in (1, 2, 4, 8) if g <= p and p % g == 0 and power_of_two(g)
            and power_of_two(p // g)]


SHAPES = [(0,), (1,), (7,), (33, 5), (1000,)]


def inputs(p, dtype, case):
    """Every rank's list, regenerated on every rank from per-rank seeds."""
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed_for("hier", case, r))
        out.append([(rng.standard_normal(s) * (1 + r)).astype(dtype) for s in SHAPES])
    return out


def reference(per_rank, group):
    p = len(per_rank)
    refs = []
    for i in range(len(SHAPES)):
        means = [np.mean([per_rank[r][i].astype(np.float64) for r in range(g, g + group)],
                         axis=0) for g in range(0, p, group)]
        refs.append(adasum_vectors([m.reshape(-1) for m in means]).reshape(SHAPES[i]))
    return refs


def check_close(got, refs, dtype):
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for i, (g, ref) in enumerate(zip(got, refs)):
        err = np.max(np.abs(g.astype(np.float64) - ref)) if ref.size else 0.0
        scale = np.max(np.abs(ref)) if ref.size else 1.0
        assert err <= rtol * (1.0 + scale), (i, err, scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_groups_against_reference(comm, dtype):
    """Each valid group size: out of place, in place (same bits), per call and
    communicator-wide, the Op enum; identical on every rank."""
    p = comm.size
    for group in valid_groups(p):
        per_rank = inputs(p, dtype, group)
        mine = [a.copy() for a in per_rank[comm.rank]]
        refs = reference(per_rank, group)
        with group_size(group):  # every call first; assertions after, together
            out = comm.allreduce(mine, "adasum", adasum="hierarchical")
            enum_out = comm.allreduce(mine, gs.Op.ADASUM_HIERARCHICAL)
            hier = gs.Communicator(adasum="hierarchical")
            wide = hier.allreduce(mine, "adasum")
            flat = hier.allreduce(mine, "adasum", adasum="flat")
            hier.close()
            plain = comm.allreduce(mine, "adasum")
            comm.allreduce_(mine, "adasum", adasum="hierarchical")
        with collectively(what=f"groups of {group}") as blk:
            check_close(out, refs, dtype)
            blk.same(out)
            for a, b, c, d in zip(out, enum_out, wide, mine):
                assert bits(a).tobytes() == bits(b).tobytes() == bits(c).tobytes() \
                    == bits(d).tobytes()
            for a, b in zip(flat, plain):
                assert bits(a).tobytes() == bits(b).tobytes()


def test_one_node_is_the_mean(comm):
    """Without the override the groups are nodes: here one node, so the mean."""
    p = comm.size
    if not power_of_two(p):
        pytest.skip("a power-of-two rank count")
    per_rank = inputs(p, np.float64, "node")
    mine = [a.copy() for a in per_rank[comm.rank]]
    if comm.local_size != p:
        pytest.skip("ranks on more than one node")
    with group_size(None):
        out = comm.allreduce(mine, "adasum", adasum="hierarchical")
    with collectively():
        means = [np.mean([per_rank[r][i] for r in range(p)], axis=0)
                 for i in range(len(SHAPES))]
        for o, m in zip(out, means):
            np.testing.assert_allclose(o, m, rtol=1e-12, atol=1e-12)


def test_bad_groups_raise_on_every_rank(comm):
    """A group size that does not fit raises ValueError naming the condition,
    on every rank, and writes nothing."""
    p = comm.size
    bad = [g for g in (3, 5, 6) if g <= p] + [g for g in (2, 4) if g <= p and
                                              not power_of_two(p // g) and p % g == 0]
    x = np.arange(10, dtype=np.float32) + comm.rank
    for g in bad:
        before = x.copy()
        with group_size(g), collectively(what=f"group of {g}"):
            with pytest.raises(ValueError, match="hierarchical adasum"):
                comm.allreduce_(x, "adasum", adasum="hierarchical")
            assert bits(x).tobytes() == bits(before).tobytes()
    with collectively():
        with pytest.raises(ValueError, match="flat.*hierarchical"):
            comm.allreduce_(x, "adasum", adasum="tree")
    with collectively():
        with pytest.raises(ValueError, match="flat.*hierarchical"):
            gs.Communicator(adasum="tree")
