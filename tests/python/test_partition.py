"""gs.Partition and gs.AllSumReduce (docs/GUIDE.md section 2.10, DistDL semantics).

Runs at any rank count; the 2x3 table needs exactly 6 ranks and DistDL's
12-worker table at least 12 (the Makefile runs this file at 6 and 12 ranks
too). Tests that need another world size skip.
"""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collective_assert, collectively, seed_for

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD

ALL_AXES_3D = [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]


def prime_factors(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def world_shapes(n):
    """Cartesian shapes with n workers: the prime factors, and with a
    size-1 axis in front and at the end."""
    f = prime_factors(n) or [1]
    shapes = [tuple(f), (1,) + tuple(f), tuple(reversed(f)) + (1,)]
    return list(dict.fromkeys(shapes))


def exhaustive_shapes(n):
    """The shapes the every-subset tests walk: all of world_shapes up to 6
    workers, only the prime factors beyond (12 oversubscribed workers must
    stay fast; DistDL's table covers them)."""
    shapes = world_shapes(n)
    return shapes if n <= 6 else shapes[:1]


def all_subsets(dim):
    return [c for k in range(dim + 1) for c in itertools.combinations(range(dim), k)]


def unravel(rank, shape):
    return tuple(int(i) for i in np.unravel_index(rank, shape))


def ravel(index, shape):
    return int(np.ravel_multi_index(tuple(index), shape))


def ref_group(rank, shape, axes_reduce):
    """Partition ranks of `rank`'s group, in row-major order of the reduced
    dimensions (an independent reimplementation for the checks)."""
    me = unravel(rank, shape)
    members = []
    for other in range(int(np.prod(shape))):
        idx = unravel(other, shape)
        if all(idx[d] == me[d] for d in range(len(shape)) if d not in axes_reduce):
            members.append(other)
    # row-major order over the reduced coordinates
    members.sort(key=lambda r: [unravel(r, shape)[d] for d in axes_reduce])
    return members


@pytest.fixture(scope="module")
def P_world(comm):
    return gs.Partition(comm)


# ------------------------------------------------------------- partitions

def test_world_partition_attributes(P_world, comm):
    with collectively():
        assert P_world.active is True
        assert (P_world.rank, P_world.size) == (comm.rank, comm.size)
        assert P_world.shape == (comm.size,) and P_world.dim == 1
        assert P_world.index == (comm.rank,)
        assert P_world.comm is comm


def test_partition_from_mpi4py_comm():
    with collectively():
        P = gs.Partition(WORLD)
        assert (P.rank, P.size, P.shape) == (WORLD.rank, WORLD.size, (WORLD.size,))
        assert isinstance(P.comm, gs.Communicator)


def test_inclusive_partition_orders_ranks_as_listed(P_world):
    n = WORLD.size
    with collectively():
        P = P_world.create_partition_inclusive(list(reversed(range(n))))
        assert P.active and P.size == n and P.rank == n - 1 - WORLD.rank
        assert P.shape == (n,) and P.dim == 1 and P.index == (P.rank,)
        # the partition's communicator ranks its workers the same way
        got = P.comm.allgather(np.array([WORLD.rank]))
        assert list(got) == list(reversed(range(n))), got


@pytest.mark.parametrize("shape_no", [0, 1, 2])
def test_cartesian_partition_is_row_major(P_world, shape_no):
    shapes = world_shapes(WORLD.size)
    if shape_no >= len(shapes):
        pytest.skip("no such shape at this world size")
    shape = shapes[shape_no]
    with collectively():
        P = P_world.create_cartesian_topology_partition(shape)
        assert P.active and P.rank == WORLD.rank and P.size == WORLD.size
        assert P.shape == shape and P.dim == len(shape)
        assert P.index == unravel(WORLD.rank, shape)
        cart = WORLD.Create_cart(list(shape), reorder=False)
        assert P.index == tuple(cart.Get_coords(cart.Get_rank()))
        cart.Free()


def test_cartesian_of_a_reordered_partition(P_world):
    """Indices follow the rank in the partition the shape is applied to."""
    n = WORLD.size
    shape = world_shapes(n)[0]
    with collectively():
        P_rev = P_world.create_partition_inclusive(list(reversed(range(n))))
        P = P_rev.create_cartesian_topology_partition(shape)
        assert P.rank == n - 1 - WORLD.rank
        assert P.index == unravel(n - 1 - WORLD.rank, shape)


def test_inactive_workers_of_an_inclusive_partition(P_world):
    """Ranks 1..n-1 listed backwards: rank 0 is left out."""
    n = WORLD.size
    if n < 2:
        pytest.skip("needs 2 ranks")
    ranks = list(range(n - 1, 0, -1))
    with collectively():
        P = P_world.create_partition_inclusive(ranks)
        if WORLD.rank == 0:
            assert (P.active, P.rank, P.size, P.index) == (False, -1, -1, None)
            assert P.comm is None
        else:
            assert P.active and P.rank == ranks.index(WORLD.rank) and P.size == n - 1
        assert P.shape == (n - 1,) and P.dim == 1
        # creation from an inactive partition stays inactive and keeps the shape
        Q = P.create_cartesian_topology_partition((1, n - 1))
        assert Q.shape == (1, n - 1) and Q.dim == 2
        assert Q.active == (WORLD.rank != 0)
        R = P.create_partition_inclusive([0])
        assert R.shape == (1,)
        assert R.active == (WORLD.rank == n - 1)


def test_cartesian_smaller_than_partition_leaves_the_rest_inactive(P_world):
    n = WORLD.size
    if n < 2:
        pytest.skip("needs 2 ranks")
    with collectively():
        P = P_world.create_cartesian_topology_partition((n - 1, 1))
        if WORLD.rank < n - 1:
            assert P.active and P.rank == WORLD.rank and P.index == (WORLD.rank, 0)
        else:
            assert (P.active, P.rank, P.size, P.index) == (False, -1, -1, None)
        assert P.shape == (n - 1, 1)


def test_partition_of_ranks_0_to_2_on_4_workers(P_world):
    """The inactive-worker case (docs/GUIDE.md section 2.10): rank 3 is outside; it passes a
    zero-volume array to AllSumReduce and gets a copy back."""
    if WORLD.size != 4:
        pytest.skip("needs exactly 4 ranks")
    P = P_world.create_partition_inclusive([0, 1, 2])
    P_x = P.create_cartesian_topology_partition([3])
    layer = gs.AllSumReduce(P_x, axes_reduce=(0,))
    with collectively():
        for Q in (P, P_x):
            if WORLD.rank == 3:
                assert (Q.active, Q.rank, Q.size, Q.index) == (False, -1, -1, None)
            else:
                assert (Q.active, Q.rank, Q.size, Q.index) == (True, WORLD.rank, 3,
                                                               (WORLD.rank,))
            assert Q.shape == (3,) and Q.dim == 1
        if WORLD.rank == 3:
            x = gs.zero_volume_array(np.float32)
        else:
            x = np.full((2, 5), WORLD.rank + 1, np.float32)
    with collectively():
        y = layer(x)
        dx = layer.adjoint(x)
        for out in (y, dx):
            assert out is not x and isinstance(out, np.ndarray)
            assert out.dtype == np.float32
            if WORLD.rank == 3:
                assert out.shape == (0,)
            else:
                assert out.shape == (2, 5) and np.all(out == 6), out


def test_zero_volume_array():
    with collectively():
        for dt in (np.float32, np.float64, np.int64, gs.bfloat16):
            z = gs.zero_volume_array(dt)
            assert isinstance(z, np.ndarray) and z.size == 0 and z.shape == (0,)
            assert z.dtype == np.dtype(dt)


# -------------------------------------------------------------- errors

def test_axes_errors(P_world):
    P = P_world.create_cartesian_topology_partition(world_shapes(WORLD.size)[1])
    dim = P.dim
    with collectively():
        for kwargs in ({}, {"axes_reduce": (0,), "axes_keep": (1,)},
                       {"axes_reduce": (), "axes_keep": ()},
                       {"axes_reduce": (dim,)}, {"axes_keep": (0, dim)},
                       {"axes_reduce": (-1,)}, {"axes_keep": (-1,)},
                       {"axes_reduce": (0, 0)}, {"axes_reduce": (0.5,)}):
            with pytest.raises(ValueError):
                gs.AllSumReduce(P, **kwargs)
        with pytest.raises(TypeError):
            gs.AllSumReduce(P_world.comm, axes_reduce=(0,))


def test_partition_errors(P_world):
    n = WORLD.size
    with collectively():
        with pytest.raises(ValueError):
            P_world.create_partition_inclusive([n])
        with pytest.raises(ValueError):
            P_world.create_partition_inclusive([-1])
        with pytest.raises(ValueError):
            P_world.create_partition_inclusive([0, 0])
        with pytest.raises(ValueError):
            P_world.create_partition_inclusive([])
        with pytest.raises(ValueError):
            P_world.create_cartesian_topology_partition([n + 1])
        with pytest.raises(ValueError):
            P_world.create_cartesian_topology_partition([n, 0])
        with pytest.raises(ValueError):
            P_world.create_cartesian_topology_partition([])
        with pytest.raises(TypeError):
            gs.Partition(None)


# -------------------------------------------------------------- AllSumReduce

def test_groups_match_mpi_cart_sub(P_world):
    """Every axes subset of every world shape: the group and its member order
    are MPI_Cart_sub's with the reduced dimensions remaining."""
    for shape in exhaustive_shapes(WORLD.size):
        P = P_world.create_cartesian_topology_partition(shape)
        cart = WORLD.Create_cart(list(shape), reorder=False)
        for axes in all_subsets(len(shape)):
            layer = gs.AllSumReduce(P, axes_reduce=axes)
            sub = cart.Sub([d in axes for d in range(len(shape))])
            # keeping no dimension gives a zero-dimensional communicator of this
            # rank alone (the MPI standard's MPI_Cart_sub); MPICH 4.3 returns
            # MPI_COMM_NULL there
            expected = [WORLD.rank] if sub == MPI.COMM_NULL else sub.allgather(WORLD.rank)
            if sub != MPI.COMM_NULL:
                sub.Free()
            with collectively(what=f"shape {shape} axes {axes}"):
                assert expected == ref_group(WORLD.rank, shape, axes)
                assert P.reduction_groups(axes)[
                    ravel([P.index[d] for d in range(len(shape)) if d not in axes],
                          [shape[d] for d in range(len(shape)) if d not in axes])
                    if len(axes) < len(shape) else 0] == expected
                if len(expected) == 1:
                    assert layer.group is None
                else:
                    got = layer.group.allgather(np.array([WORLD.rank]))
                    assert list(got) == expected, (list(got), expected)
        cart.Free()


def test_sums_over_every_axes_subset(P_world, inputs):
    """Random small-integer data (exact sums): each worker gets the sum of
    its group's inputs, for every shape and subset, one array and a list."""
    n = WORLD.size
    shapes = [(3, 4), (5,), (2, 1, 3)]
    dtypes = [np.float64, np.float32, np.int32]
    per_rank = inputs.all_ranks(shapes, dtypes, kind="small")
    mine = per_rank[WORLD.rank]
    for shape in exhaustive_shapes(n):
        P = P_world.create_cartesian_topology_partition(shape)
        for axes in all_subsets(len(shape)):
            members = ref_group(WORLD.rank, shape, axes)
            layer = gs.AllSumReduce(P, axes_reduce=axes)
            with collectively(what=f"shape {shape} axes {axes}"):
                y = layer(mine[0])
                assert isinstance(y, np.ndarray) and y is not mine[0]
                assert not np.shares_memory(y, mine[0])
                ref = sum(per_rank[m][0].astype(np.float64) for m in members)
                assert y.dtype == np.float64 and np.array_equal(y, ref)
            with collectively(what=f"list, shape {shape} axes {axes}"):
                ys = layer(mine)
                assert isinstance(ys, list) and len(ys) == 3
                for i, (yi, xi) in enumerate(zip(ys, mine)):
                    ref = sum(per_rank[m][i].astype(np.float64) for m in members)
                    assert yi.dtype == xi.dtype and yi.shape == xi.shape
                    assert yi is not xi and not np.shares_memory(yi, xi)
                    assert np.array_equal(yi.astype(np.float64), ref), (i, yi, ref)
                for xi, orig in zip(mine, per_rank[WORLD.rank]):
                    assert np.array_equal(xi, orig)  # inputs untouched


def test_axes_keep_is_the_complement_and_groups_are_cached(P_world):
    shape = world_shapes(WORLD.size)[1]
    P = P_world.create_cartesian_topology_partition(shape)
    dim = len(shape)
    with collectively():
        for axes in all_subsets(dim):
            keep = tuple(d for d in range(dim) if d not in axes)
            a = gs.AllSumReduce(P, axes_reduce=axes)
            b = gs.AllSumReduce(P, axes_keep=keep)
            c = gs.AllSumReduce(P, axes_reduce=tuple(reversed(axes)))
            assert a.axes_reduce == b.axes_reduce == c.axes_reduce == axes
            assert a.axes_keep == b.axes_keep == keep
            assert a.group is b.group is c.group
        # reducing over everything reuses the partition's own communicator
        full = gs.AllSumReduce(P, axes_reduce=tuple(range(dim)))
        if WORLD.size > 1:
            assert full.group is P.comm


def test_a_list_is_one_fused_call(P_world):
    if WORLD.size < 2:
        pytest.skip("needs 2 ranks")
    layer = gs.AllSumReduce(P_world, axes_reduce=(0,))
    xs = [np.full(s, 1.0, np.float32) for s in (7, 300, 1, 64)]
    before = layer.group.stats()["calls"]
    with collectively():
        ys = layer(xs)
        assert layer.group.stats()["calls"] - before == 1
        assert all(np.all(y == WORLD.size) for y in ys)
        assert layer([]) == []


def test_axes_empty_is_a_copy(P_world):
    layer = gs.AllSumReduce(P_world, axes_reduce=())
    x = np.arange(6.0).reshape(2, 3) + WORLD.rank
    with collectively():
        y = layer(x)
        assert y is not x and not np.shares_memory(x, y) and np.array_equal(x, y)
        dx = layer.adjoint([x, x])
        assert all(d is not x and np.array_equal(d, x) for d in dx)


def local_dots(layer, x, y):
    """This worker's (<F x, y>, <x, F* y>)."""
    return [np.vdot(layer(x), y), np.vdot(x, layer.adjoint(y))]


def summed_over_workers(values):
    """One mpi4py Allreduce of a float64 vector."""
    local = np.asarray(values, np.float64)
    total = np.empty_like(local)
    WORLD.Allreduce(local, total, op=MPI.SUM)
    return total


def random_local(tag, shape):
    rng = np.random.default_rng(seed_for("partition-adjoint", tag, WORLD.rank))
    return rng.standard_normal(shape)


def test_adjoint_on_random_data(P_world):
    """<F x, y> = <x, F* y> summed over all workers, every shape and subset
    (the local dot products of all cases go out in one exchange)."""
    cases, dots = [], []
    for shape in exhaustive_shapes(WORLD.size):
        P = P_world.create_cartesian_topology_partition(shape)
        for axes in all_subsets(len(shape)):
            layer = gs.AllSumReduce(P, axes_reduce=axes)
            x = random_local(("x", shape, axes), (3, 5))
            y = random_local(("y", shape, axes), (3, 5))
            cases.append((shape, axes))
            dots += local_dots(layer, x, y)
    total = summed_over_workers(dots).reshape(-1, 2)
    bad = [f"shape {c[0]} axes {c[1]}: <Fx,y>={lhs!r} <x,F*y>={rhs!r}"
           for c, (lhs, rhs) in zip(cases, total)
           if not np.isclose(lhs, rhs, rtol=1e-5, atol=0)]
    collective_assert(not bad, "; ".join(bad))


# -------------------------------------------------------- fixed world sizes

@pytest.mark.parametrize("axes,expected", [
    ((1,), "row"), ((0,), "column"), ((0, 1), 21.0), ((), "self")],
    ids=["axes1", "axes0", "axes01", "none"])
def test_2x3_blocks_of_rank_plus_one(P_world, axes, expected):
    if WORLD.size != 6:
        pytest.skip("needs exactly 6 ranks")
    P_x = P_world.create_cartesian_topology_partition([2, 3])
    layer = gs.AllSumReduce(P_x, axes_reduce=axes)
    x = np.full((3, 4), WORLD.rank + 1, np.float64)
    i, j = P_x.index
    want = {"row": [6.0, 15.0][i], "column": [5.0, 7.0, 9.0][j],
            "self": WORLD.rank + 1.0}.get(expected, expected)
    with collectively():
        for out in (layer(x), layer.adjoint(x)):
            assert out.shape == (3, 4) and np.all(out == want), (out, want)


def P_x_12(P_world, shape):
    """DistDL's setup: a partition of world ranks 0..11, made Cartesian."""
    P_base = P_world.create_partition_inclusive(range(12))
    return P_base.create_cartesian_topology_partition(shape)


DISTDL_TABLE = [([2, 2, 3], [3, 4], axes) for axes in ALL_AXES_3D] + \
    [([12], [30, 344], (0,))]


@pytest.mark.parametrize("P_x_shape,local_shape,axes", DISTDL_TABLE,
                         ids=[f"{'x'.join(map(str, s))}-{''.join(map(str, a)) or 'none'}"
                              for s, _, a in DISTDL_TABLE])
def test_distdl_12_workers(P_world, P_x_shape, local_shape, axes):
    """x = 10 and dy = 0.125 everywhere: y = 10 F and dx = 0.125 F exactly,
    F the product of the partition's extents over the reduced axes; and the
    adjoint identity on random data to rtol 1e-5."""
    if WORLD.size < 12:
        pytest.skip("needs 12 ranks")
    P_x = P_x_12(P_world, P_x_shape)
    layer = gs.AllSumReduce(P_x, axes_reduce=axes)
    F = float(np.prod([P_x_shape[d] for d in axes]))
    with collectively():
        if P_x.active:
            x = np.full(local_shape, 10.0)
            dy = np.full(local_shape, 0.125)
        else:
            x = dy = gs.zero_volume_array(np.float64)
        y = layer(x)
        dx = layer.adjoint(dy)
        if P_x.active:
            assert y.shape == tuple(local_shape) and np.all(y == 10.0 * F), (y.flat[0], F)
            assert dx.shape == tuple(local_shape) and np.all(dx == 0.125 * F)
        else:
            assert y.shape == (0,) and dx.shape == (0,)
    if P_x.active:
        xr = random_local(("x12", tuple(P_x_shape), axes), local_shape)
        yr = random_local(("y12", tuple(P_x_shape), axes), local_shape)
    else:
        xr = yr = gs.zero_volume_array(np.float64)
    lhs, rhs = summed_over_workers(local_dots(layer, xr, yr))
    collective_assert(np.isclose(lhs, rhs, rtol=1e-5, atol=0),
                      f"axes {axes}: <Fx,y>={lhs!r} <x,F*y>={rhs!r}")
