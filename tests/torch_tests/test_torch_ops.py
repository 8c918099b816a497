"""gradsync.torch: forward and backward of every op against float64
references built locally from every rank's deterministic inputs, at any rank
count; and a two-layer tensor-parallel MLP against the same MLP on one rank.
"""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import gradsync as gs  # noqa: E402
import gradsync.torch as gst  # noqa: E402
from gsutil import collective_assert, collectively, seed_for  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}


def rand(tag, rank, shape, dtype=torch.float64):
    """Rank `rank`'s input for `tag` (any rank can compute any rank's)."""
    rng = np.random.default_rng(seed_for("torch-ops", tag, rank))
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def all_ranks(tag, shape_of, dtype=torch.float64):
    return [rand(tag, r, shape_of(r), dtype) for r in range(SIZE)]


def close(got, ref, dtype=torch.float64, what=""):
    assert isinstance(got, torch.Tensor), (what, type(got))
    assert got.dtype == dtype, (what, got.dtype, dtype)
    assert tuple(got.shape) == tuple(ref.shape), (what, tuple(got.shape), tuple(ref.shape))
    torch.testing.assert_close(got.double(), ref.double(), msg=what, **TOL[dtype])


def balanced(n, size=SIZE):
    return [n // size + (r < n % size) for r in range(size)]


def test_import_gradsync_does_not_import_torch():
    """Checked in a fresh interpreter (rank 0, outside mpiexec's PMI)."""
    ok, msg = True, ""
    if RANK == 0:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
        code = ("import sys, gradsync; "
                "assert 'torch' not in sys.modules, 'import gradsync imported torch'")
        try:
            proc = subprocess.run([sys.executable, "-c", code], env=env,
                                  capture_output=True, text=True, timeout=120)
            ok, msg = proc.returncode == 0, proc.stderr[-2000:]
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            ok, msg = False, repr(exc)
    collective_assert(ok, msg)


# ------------------------------------------------------------------ all_reduce

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_all_reduce_forward_backward(comm, op, dtype):
    shape = (4, 3)
    xs = all_ranks("x", lambda r: shape, dtype)
    gs_ = all_ranks("g", lambda r: shape)
    scale = 1.0 / SIZE if op == "average" else 1.0
    ref_y = sum(x.double() for x in xs) * scale
    ref_dx = sum(gs_) * scale
    x = xs[RANK].clone().requires_grad_()
    with collectively():
        y = gst.all_reduce(x, comm, op=op)
        close(y, ref_y, dtype, "forward")
        assert y.requires_grad and y.data_ptr() != x.data_ptr()
    with collectively():
        y.backward(gs_[RANK].to(dtype))
        close(x.grad, ref_dx, dtype, "backward")


def test_all_reduce_list_is_fused_and_differentiable(comm):
    shapes = [(2, 3), (5,), (1, 1, 4)]
    per_rank = [[rand(("xl", i), r, s) for i, s in enumerate(shapes)] for r in range(SIZE)]
    xs = [t.clone().requires_grad_() for t in per_rank[RANK]]
    before = comm.stats()["calls"]
    with collectively():
        ys = gst.all_reduce(xs, comm)
        assert comm.stats()["calls"] - before == 1
        assert isinstance(ys, list) and len(ys) == 3
        for i, y in enumerate(ys):
            close(y, sum(per_rank[r][i] for r in range(SIZE)), what=f"tensor {i}")
    with collectively():
        # only two outputs used: the third gets a zero gradient
        (ys[0].sum() * 2 + (ys[1] ** 2).sum()).backward()
        close(xs[0].grad, torch.full(shapes[0], 2.0 * SIZE, dtype=torch.float64))
        close(xs[1].grad, 2.0 * SIZE * ys[1].detach())
        close(xs[2].grad, torch.zeros(shapes[2], dtype=torch.float64))


def test_all_reduce_non_linear_ops(comm):
    xs = all_ranks("xm", lambda r: (6,))
    x = xs[RANK].clone()
    with collectively():
        y = gst.all_reduce(x, comm, op="max")
        close(y, torch.stack(xs).max(dim=0).values)
        y = gst.all_reduce(x, comm, op=gs.Op.MIN)
        close(y, torch.stack(xs).min(dim=0).values)
        with pytest.raises(ValueError, match="self-adjoint"):
            gst.all_reduce(x.clone().requires_grad_(), comm, op="max")
    with collectively():
        with torch.no_grad():
            y = gst.all_reduce(x.clone().requires_grad_(), comm, op="max")
        close(y, torch.stack(xs).max(dim=0).values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32],
                         ids=["f16", "bf16", "i32"])
def test_all_reduce_other_dtypes(comm, dtype):
    """Small integers: exact in every dtype (host bfloat16 goes through an
    ml_dtypes view)."""
    x = torch.arange(8).to(dtype) + RANK
    with collectively():
        y = gst.all_reduce(x, comm)
        ref = torch.arange(8, dtype=torch.float64) * SIZE + SIZE * (SIZE - 1) / 2
        assert y.dtype == dtype and torch.equal(y.double(), ref), y


def test_non_contiguous_input(comm):
    xs = all_ranks("nc", lambda r: (3, 4))
    x = xs[RANK].clone().requires_grad_()
    with collectively():
        y = gst.all_reduce(x.t(), comm)
        close(y, sum(xs).t())
        y.sum().backward()  # an expanded, non-contiguous gradient
        close(x.grad, torch.full((3, 4), float(SIZE), dtype=torch.float64))


# ------------------------------------------------------------------- AllReduce

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_AllReduce_sum_forward_identity_backward(comm, dtype):
    xs = all_ranks("ar", lambda r: (3, 5), dtype)
    g = rand("arg", RANK, (3, 5), dtype)
    x = xs[RANK].clone().requires_grad_()
    module = gst.AllReduce(comm)
    with collectively():
        y = module(x)
        close(y, sum(x.double() for x in xs), dtype)
        if SIZE == 1:
            assert y is x
    with collectively():
        y.backward(g)
        assert torch.equal(x.grad, g), "the input gradient is the output gradient"


def test_AllReduce_returns_its_input_on_one_rank(comm):
    solo = comm.split(RANK)  # one rank per communicator
    x = torch.ones(3, requires_grad=True)
    with collectively():
        module = gst.AllReduce(solo)
        assert module(x) is x
        xs = [x, x * 2]
        assert module(xs) is xs
    solo.close()


def test_AllReduce_list(comm):
    xs = [torch.full((2,), float(RANK + 1), requires_grad=True),
          torch.full((3, 1), 1.0, dtype=torch.float64, requires_grad=True)]
    with collectively():
        ys = gst.AllReduce(comm)(xs)
        assert torch.equal(ys[0].detach(), torch.full((2,), SIZE * (SIZE + 1) / 2))
        assert torch.equal(ys[1].detach(), torch.full((3, 1), float(SIZE), dtype=torch.float64))
        (ys[0].sum() + 3 * ys[1].sum()).backward()
        assert torch.equal(xs[0].grad, torch.ones(2))
        assert torch.equal(xs[1].grad, torch.full((3, 1), 3.0, dtype=torch.float64))


# ------------------------------------------------- all_gather / reduce_scatter

ROWS = {
    "even": lambda r: 2,
    "balanced_uneven": lambda r: balanced(2 * SIZE + 1)[r],
    "arbitrary": lambda r: (3, 0, 1, 2)[r % 4],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("rows", list(ROWS), ids=list(ROWS))
def test_all_gather_forward_backward(comm, rows, dtype):
    nrows = [ROWS[rows](r) for r in range(SIZE)]
    n = sum(nrows)
    xs = all_ranks(("ag", rows), lambda r: (nrows[r], 3), dtype)
    gs_ = all_ranks(("agg", rows), lambda r: (n, 3), dtype)
    x = xs[RANK].clone().requires_grad_()
    start = sum(nrows[:RANK])
    with collectively():
        y = gst.all_gather(x, comm)
        close(y, torch.cat([t.double() for t in xs]), dtype, "forward")
    with collectively():
        y.backward(gs_[RANK])
        ref = sum(g.double() for g in gs_)[start:start + nrows[RANK]]
        close(x.grad, ref, dtype, "backward")
    if nrows == balanced(n):
        # the backward IS reduce_scatter of the gradient
        with collectively():
            rs = gst.reduce_scatter(gs_[RANK], comm)
            assert torch.equal(x.grad, rs), "backward != reduce_scatter(grad)"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n", ["even", "uneven", "fewer_rows_than_ranks"])
def test_reduce_scatter_forward_backward(comm, n, dtype):
    n = {"even": 2 * SIZE, "uneven": 2 * SIZE + 1, "fewer_rows_than_ranks": max(SIZE - 1, 1)}[n]
    blocks = balanced(n)
    start = sum(blocks[:RANK])
    xs = all_ranks(("rs", n), lambda r: (n, 2, 2), dtype)
    gs_ = [rand(("rsg", n), r, (blocks[r], 2, 2), dtype) for r in range(SIZE)]
    x = xs[RANK].clone().requires_grad_()
    with collectively():
        y = gst.reduce_scatter(x, comm)
        close(y, sum(t.double() for t in xs)[start:start + blocks[RANK]], dtype, "forward")
    with collectively():
        y.backward(gs_[RANK])
        close(x.grad, torch.cat([g.double() for g in gs_]), dtype, "backward")
    with collectively():
        # the backward IS all_gather of the gradient
        ag = gst.all_gather(gs_[RANK], comm)
        assert torch.equal(x.grad, ag), "backward != all_gather(grad)"


def test_all_gather_then_reduce_scatter_round_trip(comm):
    """reduce_scatter(all_gather(x)) = size * x on balanced rows, and the
    gradient through both is size * g."""
    rows = balanced(2 * SIZE + 1)[RANK]
    x = rand("rt", RANK, (rows, 4)).requires_grad_()
    g = rand("rtg", RANK, (rows, 4))
    with collectively():
        y = gst.reduce_scatter(gst.all_gather(x, comm), comm)
        close(y, SIZE * x.detach())
        y.backward(g)
        close(x.grad, SIZE * g)


def test_rows_errors(comm):
    with collectively():
        with pytest.raises(ValueError):
            gst.all_gather(torch.tensor(1.0), comm)
        with pytest.raises(ValueError):
            gst.reduce_scatter(torch.tensor(1.0), comm)
        with pytest.raises(TypeError):
            gst.all_gather(np.ones(3), comm)


# ---------------------------------------------------------------- AllSumReduce

def world_shape():
    f, n, p = [], SIZE, 2
    while n > 1:
        while n % p == 0:
            f.append(p)
            n //= p
        p += 1
    return tuple(f) + (1,)


def group_of(rank, shape, axes):
    me = np.unravel_index(rank, shape)
    return [r for r in range(SIZE)
            if all(np.unravel_index(r, shape)[d] == me[d]
                   for d in range(len(shape)) if d not in axes)]


def test_AllSumReduce_every_axes_subset(comm):
    shape = world_shape()
    P_x = gst.Partition(comm).create_cartesian_topology_partition(shape)
    xs = all_ranks("asr", lambda r: (2, 3))
    gs_ = all_ranks("asrg", lambda r: (2, 3))
    for k in range(len(shape) + 1):
        for axes in itertools.combinations(range(len(shape)), k):
            members = group_of(RANK, shape, axes)
            layer = gst.AllSumReduce(P_x, axes_reduce=axes)
            assert isinstance(layer, torch.nn.Module)
            x = xs[RANK].clone().requires_grad_()
            with collectively(what=f"axes {axes}"):
                y = layer(x)
                assert y.data_ptr() != x.data_ptr()
                close(y, sum(xs[m] for m in members), what="forward")
                y.backward(gs_[RANK])
                close(x.grad, sum(gs_[m] for m in members), what="backward")


def test_AllSumReduce_inactive_workers_and_lists(comm):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    P = gst.Partition(comm).create_partition_inclusive(range(1, SIZE))
    layer = gst.AllSumReduce(P, axes_keep=())
    with collectively():
        if RANK == 0:
            xs = [gst.zero_volume_tensor(torch.float64, requires_grad=True),
                  gst.zero_volume_tensor(torch.float32, requires_grad=True)]
        else:
            xs = [torch.full((2, 2), float(RANK), dtype=torch.float64, requires_grad=True),
                  torch.full((3,), 1.0, requires_grad=True)]
        ys = layer(xs)
        assert [y.dtype for y in ys] == [torch.float64, torch.float32]
        for x, y in zip(xs, ys):
            assert y is not x and y.shape == x.shape
        (ys[0].sum() + 2 * ys[1].sum()).backward()
        if RANK != 0:
            assert torch.all(ys[0] == SIZE * (SIZE - 1) / 2)
            assert torch.all(ys[1] == SIZE - 1)
            assert torch.all(xs[0].grad == SIZE - 1)
            assert torch.all(xs[1].grad == 2 * (SIZE - 1))
        else:
            assert xs[0].grad.shape == (0,) and xs[1].grad.shape == (0,)


# --------------------------------------------------------- tensor-parallel MLP

class MLP(torch.nn.Module):
    def __init__(self, d_in, hidden, d_out):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(hidden, d_out, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TensorParallelMLP(torch.nn.Module):
    """fc1 column-parallel (this rank's block of hidden units), fc2
    row-parallel (the matching input columns, no bias), then AllReduce and
    the replicated bias."""

    def __init__(self, full, comm):
        super().__init__()
        hidden = full.fc1.out_features
        sizes = balanced(hidden, comm.size)
        self.lo = sum(sizes[:comm.rank])
        self.hi = self.lo + sizes[comm.rank]
        sl = slice(self.lo, self.hi)
        self.w1 = torch.nn.Parameter(full.fc1.weight.detach()[sl].clone())
        self.b1 = torch.nn.Parameter(full.fc1.bias.detach()[sl].clone())
        self.w2 = torch.nn.Parameter(full.fc2.weight.detach()[:, sl].clone())
        self.b2 = torch.nn.Parameter(full.fc2.bias.detach().clone())
        self.reduce = gst.AllReduce(comm)

    def forward(self, x):
        h = torch.relu(x @ self.w1.t() + self.b1)
        return self.reduce(h @ self.w2.t()) + self.b2


@pytest.mark.parametrize("hidden", [8, 7], ids=["even", "uneven"])
def test_tensor_parallel_mlp_matches_one_rank(comm, hidden):
    torch.manual_seed(1234)  # the same full model and data on every rank
    full = MLP(5, hidden, 3)
    x = torch.randn(6, 5, dtype=torch.float64)
    target = torch.randn(6, 3, dtype=torch.float64)

    ref_out = full(x)
    torch.nn.functional.mse_loss(ref_out, target).backward()

    tp = TensorParallelMLP(full, comm)
    with collectively():
        out = tp(x)
        torch.nn.functional.mse_loss(out, target).backward()
        tol = dict(rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(out, ref_out, **tol)
        sl = slice(tp.lo, tp.hi)
        torch.testing.assert_close(tp.w1.grad, full.fc1.weight.grad[sl], **tol)
        torch.testing.assert_close(tp.b1.grad, full.fc1.bias.grad[sl], **tol)
        torch.testing.assert_close(tp.w2.grad, full.fc2.weight.grad[:, sl], **tol)
        torch.testing.assert_close(tp.b2.grad, full.fc2.bias.grad, **tol)
