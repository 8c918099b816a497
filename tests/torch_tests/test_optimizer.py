"""gradsync.torch.DistributedOptimizer, broadcast_parameters and
broadcast_optimizer_state, at any rank count.

Every rank generates the WHOLE global batch of every step from a seed and
trains on its own rows of it; the references are single-process runs that
every rank computes locally from the same seeds, so a failure on one rank is
reported on all of them (collective_assert) without any rank waiting alone.

Layout of a step's global batch: SIZE * K * B rows (K micro-batches of B rows
per rank); rank r's micro-batch j is rows [(r*K + j)*B, (r*K + j + 1)*B).
With equal micro-batches the mean of the micro-batch mean losses is the mean
loss over the global batch, so averaging over micro-batches and ranks gives
the gradient of the concatenated batch.
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from adasum_reference import adasum_vectors  # noqa: E402  (tests/python, via conftest)

import gradsync.torch as gst  # noqa: E402
from gsutil import collective_assert, collectively, seed_for  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
B = 4            # rows per micro-batch per rank
STEPS = 20
LR, MOMENTUM = 0.05, 0.9
BUCKET_BYTES = 512   # several buckets for this small net, several requests in flight


class Net(torch.nn.Module):
    """A small CNN: two convolutions and two linear layers (1,011 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, stride=2)
        self.fc1 = torch.nn.Linear(36, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        x = torch.tanh(self.conv1(x))
        x = torch.tanh(self.conv2(x))
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


def make_net(tag, dtype=torch.float32):
    torch.manual_seed(seed_for(tag, "init") % 2**31)
    return Net().to(dtype)


def global_batch(tag, step, K, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed_for(tag, "data", step) % 2**63)
    n = SIZE * K * B
    x = torch.randn(n, 2, 8, 8, generator=g)
    y = torch.randn(n, 3, generator=g)
    return x.to(dtype), y.to(dtype)


def rows(r, j, K):
    start = (r * K + j) * B
    return slice(start, start + B)


def loss_fn(model, x, y):
    return F.mse_loss(model(x), y)   # mean over the rows


def train_distributed(comm, tag, dtype=torch.float32, K=1, steps=STEPS, op="average",
                      pattern="step_each", bucket_bytes=BUCKET_BYTES, nan_step=None,
                      compression=None, lr=LR, momentum=MOMENTUM):
    """Data-parallel training; returns (model, opt). ``pattern``:
    "step_each" calls step() and zero_grad() after every micro-batch (it
    steps on every K-th), "step_once" after K backward passes; a "_keep"
    suffix calls zero_grad(set_to_none=False) (backward then adds straight
    into the buckets).
    ``nan_step``: at that step the last rank's last micro-batch gets a NaN."""
    model = make_net(tag, dtype)
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = gst.DistributedOptimizer(inner, model.named_parameters(), op=op,
                                   backward_passes_per_step=K, bucket_bytes=bucket_bytes,
                                   compression=compression, comm=comm)
    for t in range(steps):
        x, y = global_batch(tag, t, K, dtype)
        for j in range(K):
            xs = x[rows(RANK, j, K)].clone()
            if t == nan_step and RANK == SIZE - 1 and j == K - 1:
                xs[0, 0, 0, 0] = math.nan
            loss_fn(model, xs, y[rows(RANK, j, K)]).backward()
            if pattern.startswith("step_each"):
                opt.step()
                opt.zero_grad(set_to_none=not pattern.endswith("_keep"))
        if pattern.startswith("step_once"):
            opt.step()
            opt.zero_grad(set_to_none=not pattern.endswith("_keep"))
    return model, opt


def train_reference(tag, K=1, steps=STEPS, skip=()):
    """One process, float32, one backward over the concatenated global batch
    per step (steps in ``skip`` are left out)."""
    model = make_net(tag)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for t in range(steps):
        if t in skip:
            continue
        x, y = global_batch(tag, t, K)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return model


def train_reference_lowp(tag, dtype, K=1, steps=STEPS):
    """One process mimicking the low-precision data path: every (rank,
    micro-batch) gradient is computed in ``dtype`` exactly as that rank
    computes it (same values, same shapes, one thread), summed in float64,
    divided by SIZE*K and rounded ONCE to ``dtype``, then SGD steps in
    ``dtype``. DistributedOptimizer sums in float32 (exact for a few
    bfloat16/float16 values of similar magnitude; the rank sum rounds only
    in float32) and rounds once to ``dtype``: the two agree except where the
    float32 and float64 values straddle a rounding boundary of ``dtype``."""
    model = make_net(tag, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = list(model.parameters())
    for t in range(steps):
        x, y = global_batch(tag, t, K, dtype)
        acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        for r in range(SIZE):
            for j in range(K):
                model.zero_grad(set_to_none=True)
                loss_fn(model, x[rows(r, j, K)].clone(), y[rows(r, j, K)]).backward()
                for a, p in zip(acc, params):
                    a += p.grad.double()
        for a, p in zip(acc, params):
            p.grad = (a / (SIZE * K)).to(dtype)
        opt.step()
    return model


def bits(tensors):
    """NumPy integer views of the tensors' bytes (for bitwise comparisons)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [t.detach().contiguous().view(ints[t.element_size()]).numpy() for t in tensors]


def max_rel_error(model, ref):
    """max |p - p_ref| / (max |p_ref| of that tensor), over the parameters."""
    worst, where = 0.0, None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        a, b = p.detach().double(), q.detach().double()
        if not torch.isfinite(a).all():
            return math.inf, name
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if err > worst:
            worst, where = err, name
    return worst, where


def check_close(model, ref, rtol, what):
    err, where = max_rel_error(model, ref)
    collective_assert(err <= rtol, f"{what}: parameter {where} differs from the reference by "
                                   f"{err:.3g} of its largest element (allowed {rtol:.3g})")
    with collectively(what=what) as blk:   # and bitwise identical on every rank
        blk.same(bits(model.parameters()))


# ------------------------------------------------------------------ average

# float32: the distributed run sums K*SIZE micro-batch means in another order
# than one backward over the whole batch (and rounds the sums and the 1/(K*SIZE)
# scaling separately), so the gradients differ by a few float32 ulps, which 20
# steps of momentum SGD carry along (measured: at most 1.7e-6 of a tensor's
# largest element at 4 ranks). 2e-5 leaves a factor 10 for other rank counts and
# is far below what a real error does (a missing micro-batch or rank, a wrong
# 1/K or 1/SIZE: ~1e-2).
F32_RTOL = 2e-5


@pytest.mark.parametrize("K,pattern", [(1, "step_each"), (1, "step_each_keep"),
                                       (3, "step_each"), (3, "step_each_keep"),
                                       (3, "step_once"), (3, "step_once_keep")])
def test_average_matches_concatenated_batch(comm, K, pattern):
    tag = ("average", K, pattern)
    model, opt = train_distributed(comm, tag, K=K, pattern=pattern)
    ref = train_reference(tag, K=K)
    check_close(model, ref, F32_RTOL, f"average K={K} {pattern}")
    collective_assert(opt.skipped_steps == 0, f"skipped_steps {opt.skipped_steps}")
    collective_assert(len(opt.bucket_names()) > 1, "expected several buckets")


# bfloat16 / float16 parameters: gradients are accumulated and reduced in
# float32 and rounded once to the parameter dtype; the reference
# (train_reference_lowp) does the same in float64. They differ only where the
# float32 and float64 values round to different neighbours in the parameter
# dtype: one ulp of one gradient element, which moves a parameter by lr times
# that ulp, far below an ulp of the parameter. So the bound is one ulp of the
# dtype relative to each tensor's largest element: 2**-8 (bfloat16) and 2**-11
# (float16); measured: bitwise equal at 1-4 ranks. (Against a float32 run
# the low-precision parameters differ by 2e-2 (bfloat16) and 3e-3 (float16):
# the forward pass's own rounding, which says nothing about the optimizer.)
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11)])
@pytest.mark.parametrize("K", [1, 3])
def test_low_precision_parameters(comm, dtype, rtol, K):
    tag = ("lowp", str(dtype), K)
    model, opt = train_distributed(comm, tag, dtype=dtype, K=K)
    ref = train_reference_lowp(tag, dtype, K=K)
    collective_assert(all(p.dtype == dtype for p in model.parameters()), "dtype changed")
    check_close(model, ref, rtol, f"{dtype} K={K}")


def test_sum_op(comm):
    """op="sum": the gradient is SIZE times the average (micro-batches are
    still averaged), which with lr/SIZE gives the same parameters."""
    tag = ("sum",)
    model = make_net(tag)
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR / SIZE),
                                   model.named_parameters(), op="sum",
                                   backward_passes_per_step=2, comm=comm)
    for t in range(3):
        x, y = global_batch(tag, t, 2)
        for j in range(2):
            loss_fn(model, x[rows(RANK, j, 2)], y[rows(RANK, j, 2)]).backward()
        opt.step()
        opt.zero_grad()
    ref = make_net(tag)
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    for t in range(3):
        x, y = global_batch(tag, t, 2)
        ropt.zero_grad()
        loss_fn(ref, x, y).backward()
        ropt.step()
    check_close(model, ref, F32_RTOL, "sum")


def _synchronized_step(comm, tag, **options):
    """One backward and synchronize on a DistributedOptimizer with options:
    the model, the optimizer, the synchronized gradients (float64) and every
    rank's own gradients computed locally, the reference."""
    model = make_net(tag)
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   model.named_parameters(), bucket_bytes=BUCKET_BYTES,
                                   comm=comm, **options)
    x, y = global_batch(tag, 0, 1)
    loss_fn(model, x[rows(RANK, 0, 1)], y[rows(RANK, 0, 1)]).backward()
    opt.synchronize()
    got = [p.grad.double().clone() for p in model.parameters()]
    per_rank = []
    for r in range(SIZE):
        m = make_net(tag)
        loss_fn(m, x[rows(r, 0, 1)], y[rows(r, 0, 1)]).backward()
        per_rank.append([p.grad.double() for p in m.parameters()])
    return model, opt, got, per_rank


@pytest.mark.parametrize("compression,bound", [("fp16", 2**-11), ("bf16", 2**-8)])
def test_compression_one_step(comm, compression, bound):
    """The synchronized gradient with compression: each rank's float32
    gradient is scaled by 1/SIZE and rounded to the wire dtype, the sum over
    ranks rounds once per step in the wire dtype, then it is widened again:
    at most (SIZE + 1) unit roundoffs u of the sum of magnitudes."""
    tag = ("compression", compression)
    model, opt, got, per_rank = _synchronized_step(comm, tag, compression=compression)
    bad = []
    for i, g in enumerate(got):
        exact = sum(pr[i] for pr in per_rank) / SIZE
        mag = sum(pr[i].abs() for pr in per_rank) / SIZE
        tol = (SIZE + 1) * bound * mag + 1e-7
        if not bool(((g - exact).abs() <= tol).all()):
            bad.append(i)
    collective_assert(not bad, f"{compression}: parameters {bad} outside the bound")
    with collectively(what="compression step") as blk:
        opt.step()
        blk.same(bits(model.parameters()))


@pytest.mark.parametrize("wire,u", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_wire_one_step(comm, wire, u):
    """DistributedOptimizer(wire=...): each rank's float32 gradient is
    rounded once to the wire format, the owner sums in float32, averages and
    rounds once: at most u * (the mean of magnitudes + |the mean|), whatever
    the rank count; the same bits on every rank; a residual kept per bucket."""
    tag = ("wire", wire)
    model, opt, got, per_rank = _synchronized_step(comm, tag, wire=wire)
    bad = []
    for i, g in enumerate(got):
        exact = sum(pr[i] for pr in per_rank) / SIZE
        mag = sum(pr[i].abs() for pr in per_rank) / SIZE
        tol = 1.01 * u * (mag + exact.abs()) + 1e-7
        if not bool(((g - exact).abs() <= tol).all()):
            bad.append(i)
    collective_assert(not bad, f"{wire}: parameters {bad} outside the bound")
    held = SIZE == 1 or all(b.feedback.state is not None for b in opt._buckets)
    collective_assert(held, "a bucket without its residual")
    with collectively(what="wire step") as blk:
        opt.step()
        blk.same(bits(model.parameters()))


def test_wire_refusals(comm):
    model = make_net(("wire-refusal",))
    for kwargs in ({"wire": "fp8"}, {"wire": "bfloat16", "op": "adasum"},
                   {"wire": "bfloat16", "compression": "fp16"}):
        with pytest.raises(ValueError, match="wire"):
            gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                     model.named_parameters(), comm=comm, **kwargs)


# ---------------------------------------------------------------- non-finite

def test_nan_on_one_rank_skips_everywhere(comm):
    """A NaN in the last rank's input at step 2: the reduced gradient is NaN on
    every rank, so every rank skips that step (parameters and momentum
    unchanged), counts it, and the later steps match a reference that left
    the step out."""
    tag = ("nan",)
    steps, nan_step = 6, 2
    before = after = None
    model = make_net(tag)
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                   momentum=MOMENTUM),
                                   model.named_parameters(), bucket_bytes=BUCKET_BYTES,
                                   comm=comm)
    for t in range(steps):
        x, y = global_batch(tag, t, 1)
        xs = x[rows(RANK, 0, 1)].clone()
        if t == nan_step and RANK == SIZE - 1:
            xs[0, 0, 0, 0] = math.nan
        if t == nan_step:
            before = [p.detach().clone() for p in model.parameters()]
        loss_fn(model, xs, y[rows(RANK, 0, 1)]).backward()
        opt.step()
        opt.zero_grad()
        if t == nan_step:
            after = [p.detach().clone() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(before, after))
    collective_assert(same, "parameters changed at the skipped step")
    collective_assert(opt.skipped_steps == 1, f"skipped_steps is {opt.skipped_steps}")
    ref = train_reference(tag, K=1, steps=steps, skip=(nan_step,))
    check_close(model, ref, F32_RTOL, "after the skipped step")


def test_nan_with_accumulation_and_pattern_once(comm):
    """The same through the micro-batch path (K=2, step once per step)."""
    tag = ("nan-k",)
    model, opt = train_distributed(comm, tag, K=2, steps=4, pattern="step_once", nan_step=1)
    collective_assert(opt.skipped_steps == 1, f"skipped_steps is {opt.skipped_steps}")
    ref = train_reference(tag, K=2, steps=4, skip=(1,))
    check_close(model, ref, F32_RTOL, "K=2 after the skipped step")


def test_grad_scaler_pattern(comm):
    """Horovod's GradScaler pattern: synchronize, unscale_, step inside
    skip_synchronize. An inf on one rank makes every rank skip the step and
    back off the scale alike; other steps train."""
    tag = ("scaler",)
    model = make_net(tag)
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   model.named_parameters(), bucket_bytes=BUCKET_BYTES,
                                   comm=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scales, changed = [], []
    for t in range(4):
        x, y = global_batch(tag, t, 1)
        xs = x[rows(RANK, 0, 1)].clone()
        if t == 1 and RANK == 0:
            xs[0, 0, 0, 0] = math.inf
        old = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(loss_fn(model, xs, y[rows(RANK, 0, 1)])).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        changed.append(not all(torch.equal(a, p) for a, p in zip(old, model.parameters())))
    collective_assert(changed == [True, False, True, True], f"changed per step: {changed}")
    collective_assert(scales[1] == scales[0] / 2, f"scales {scales}")
    with collectively(what="scaler") as blk:
        blk.same(bits(model.parameters()) + [np.array(scales)])


# -------------------------------------------------------------------- adasum

def test_adasum_first_step_is_the_tree_of_deltas(comm):
    """op="adasum": each rank steps SGD on its own gradient; the parameters
    then move by the spec's Adasum tree (adasum_vectors, float64) of the
    per-rank changes, per tensor."""
    tag = ("adasum",)
    lr = 0.1
    model = make_net(tag)
    old = [p.detach().double().clone() for p in model.parameters()]
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   model.named_parameters(), op="adasum", comm=comm)
    x, y = global_batch(tag, 0, 1)
    loss_fn(model, x[rows(RANK, 0, 1)], y[rows(RANK, 0, 1)]).backward()
    opt.step()
    deltas = []   # [rank][tensor]: what each rank's local SGD step does
    for r in range(SIZE):
        m = make_net(tag)
        o = torch.optim.SGD(m.parameters(), lr=lr)
        loss_fn(m, x[rows(r, 0, 1)], y[rows(r, 0, 1)]).backward()
        o.step()
        deltas.append([p.detach().double() - q for p, q in zip(m.parameters(), old)])
    bad = []
    for i, (p, o) in enumerate(zip(model.parameters(), old)):
        want = adasum_vectors([d[i].numpy().reshape(-1) for d in deltas])
        got = (p.detach().double() - o).numpy().reshape(-1)
        # float32 storage of old, new and delta: a few ulps of the parameter
        tol = 4 * 2.0**-24 * np.abs(o.numpy().reshape(-1)) + 1e-6 * np.abs(want).max()
        if not np.all(np.abs(got - want) <= tol):
            bad.append((i, float(np.abs(got - want).max())))
    collective_assert(not bad, f"adasum update differs from the tree: {bad}")
    with collectively(what="adasum") as blk:
        blk.same(bits(model.parameters()))


def test_adasum_nan_skips_and_continues(comm):
    tag = ("adasum-nan",)
    model = make_net(tag)
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), op="adasum",
                                   backward_passes_per_step=2, comm=comm)
    history = []
    for t in range(3):
        x, y = global_batch(tag, t, 2)
        before = [p.detach().clone() for p in model.parameters()]
        for j in range(2):
            xs = x[rows(RANK, j, 2)].clone()
            if t == 0 and j == 1 and RANK == SIZE - 1:
                xs[0, 0, 0, 0] = math.nan
            loss_fn(model, xs, y[rows(RANK, j, 2)]).backward()
            opt.step()
        opt.zero_grad()
        history.append(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    collective_assert(history == [False, True, True] and finite,
                      f"changed per step {history}, finite {finite}")
    collective_assert(opt.skipped_steps == 1, f"skipped_steps is {opt.skipped_steps}")
    with collectively(what="adasum after skip") as blk:
        blk.same(bits(model.parameters()))


# ---------------------------------------------------------- other behaviours

def test_determinism_bitwise(comm):
    """Two identical runs give bitwise-identical parameters."""
    a, _ = train_distributed(comm, ("det",), K=2, steps=8)
    b, _ = train_distributed(comm, ("det",), K=2, steps=8)
    same = all(np.array_equal(x, y) for x, y in zip(bits(a.parameters()), bits(b.parameters())))
    collective_assert(same, "two identical runs differ")


class Branchy(torch.nn.Module):
    """A parameter that only rank 0 uses, and one that nobody uses, in the
    middle of the parameter order (their buckets never fill during backward
    on some ranks, so the buckets after them wait until synchronize())."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.rank0_only = torch.nn.Parameter(torch.arange(5, dtype=torch.float32))
        self.unused = torch.nn.Parameter(torch.ones(3))
        self.b = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_parameters_without_gradients(comm, set_to_none):
    """Step 1: rank0_only gets a gradient on rank 0 only (average: w/SIZE),
    unused on no rank (zeros). Step 2: nobody uses rank0_only: its gradient is
    zero, not what its accumulator held from step 1."""
    torch.manual_seed(5)
    model = Branchy()
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), bucket_bytes=16, comm=comm)
    x = torch.ones(4, 6)
    seen = []
    for step in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        w = model.rank0_only.detach().clone()
        loss = model(x).square().mean()
        if RANK == 0 and step == 0:
            loss = loss + 0.5 * model.rank0_only.square().sum()
        loss.backward()
        opt.synchronize()
        seen.append((w, model.rank0_only.grad.clone(), model.unused.grad.clone()))
        opt.step()
    (w0, g0, gu0), (_, g1, gu1) = seen
    ok = (torch.allclose(g0, w0 / SIZE, rtol=1e-6) and bool((gu0 == 0).all())
          and bool((g1 == 0).all()) and bool((gu1 == 0).all()))
    collective_assert(ok, f"rank0_only.grad {g0} then {g1}, unused.grad {gu0} then {gu1}")
    with collectively(what="branchy") as blk:
        blk.same(bits(model.parameters()))


def test_too_many_backward_passes_raise(comm):
    model = make_net(("too-many",))
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   model.named_parameters(), op="adasum", comm=comm)
    x, y = global_batch(("too-many",), 0, 1)
    loss_fn(model, x[:B], y[:B]).backward()
    with collectively(what="raise") as _:
        with pytest.raises(RuntimeError, match="backward_passes_per_step"):
            loss_fn(model, x[:B], y[:B]).backward()
    opt.synchronize()   # local for adasum except one small flag allreduce
    opt.zero_grad()


def test_wrapper_behaves_like_the_optimizer(comm):
    model = make_net(("wrap",))
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = gst.DistributedOptimizer(inner, model.named_parameters(), comm=comm)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = global_batch(("wrap",), 0, 1)
    loss_fn(model, x[rows(RANK, 0, 1)], y[rows(RANK, 0, 1)]).backward()
    opt.step()
    sched.step()
    with collectively(what="wrapper") as _:
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
        sd = opt.state_dict()
        assert len(sd["state"]) == len(list(model.parameters()))
        opt.load_state_dict(sd)
        with pytest.raises(ValueError, match="op must be"):
            gst.DistributedOptimizer(inner, op="max", comm=comm)
        with pytest.raises(ValueError, match="not in named_parameters"):
            gst.DistributedOptimizer(inner, list(model.named_parameters())[1:], comm=comm)
    opt.zero_grad()


# ---------------------------------------------------------------- broadcasts

class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.low = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.zeros(2, 2, dtype=torch.bool))
        self.register_buffer("t", torch.zeros(3, 2).t())   # not contiguous


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.dtype == torch.bool:
                v.copy_(torch.rand(v.shape, generator=g) > 0.5)
            elif v.dtype == torch.int64:
                v.fill_(seed % 1000)
            else:
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))


@pytest.mark.parametrize("form", ["module", "state_dict", "named_parameters"])
def test_broadcast_parameters(comm, form):
    root = SIZE - 1
    model = WithBuffers()
    _randomize(model, 100 + RANK)
    expected = WithBuffers()
    _randomize(expected, 100 + root)
    arg = {"module": model, "state_dict": model.state_dict(),
           "named_parameters": list(model.named_parameters())}[form]
    gst.broadcast_parameters(arg, root=root, comm=comm)
    got, want = model.state_dict(), expected.state_dict()
    if form == "named_parameters":
        names = [n for n, _ in model.named_parameters()]
        got = {n: got[n] for n in names}
        want = {n: want[n] for n in names}
    same = all(torch.equal(got[k], want[k]) for k in want)
    collective_assert(same, f"{form}: not root's values")


def test_broadcast_optimizer_state(comm):
    """Ranks with different Adam states (rank 1 none at all), learning rates
    and step counts end with root's, bitwise."""
    root = 0
    model = make_net(("opt-state",))
    gst.broadcast_parameters(model, root=root, comm=comm)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (RANK + 1), betas=(0.8, 0.99))
    x, y = global_batch(("opt-state",), 0, 1)
    steps = 0 if RANK == 1 else RANK + 2
    for i in range(steps):
        opt.zero_grad()
        loss_fn(model, x[i % len(x):][:B], y[i % len(y):][:B]).backward()
        opt.step()
    root_state = None
    if RANK == root:
        root_state = {k: {n: v.clone() for n, v in s.items()}
                      for k, s in opt.state_dict()["state"].items()}
    dopt = gst.DistributedOptimizer(opt, model.named_parameters(), comm=comm)
    gst.broadcast_optimizer_state(dopt, root=root, comm=comm)
    sd = opt.state_dict()
    ok = (sd["param_groups"][0]["lr"] == 1e-3 and len(sd["state"]) == 8
          and all(float(s["step"]) == 2 for s in sd["state"].values()))
    if RANK == root:
        ok = ok and all(torch.equal(sd["state"][k][n], v)
                        for k, s in root_state.items() for n, v in s.items())
    collective_assert(ok, f"lr {sd['param_groups'][0]['lr']}, {len(sd['state'])} states")
    with collectively(what="optimizer state") as blk:
        blk.same(bits([v for k in sorted(sd["state"]) for _, v in
                       sorted(sd["state"][k].items())]))
