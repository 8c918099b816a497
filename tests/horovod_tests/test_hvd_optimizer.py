"""DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object, Compression and SyncBatchNorm: Horovod's
test_torch.py assertions for them, plus training that must equal one
process on the concatenated batch (backward_passes_per_step, predivision,
Adasum)."""
import copy
import inspect
import itertools
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch.nn.functional as F  # noqa: E402
from hvdtest import Checks, hvd, torch

pytestmark = pytest.mark.mpi
needs_two = pytest.mark.skipif(hvd.size() == 1, reason="needs two ranks")

# torch.optim.Optimizer's direct subclasses, as Horovod's tests take them
# (LBFGS and SparseAdam excluded as there; Muon takes 2-D parameters only)
OPTIMIZERS = sorted(((s.__name__, s) for s in torch.optim.Optimizer.__subclasses__()
                     if s.__module__.startswith("torch.optim") and
                     s not in (torch.optim.LBFGS, torch.optim.SparseAdam) and
                     s.__name__ != "Muon"), key=lambda t: t[0])
OPT_PARAMS = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]
N, D_IN, H, D_OUT = 64, 100, 10, 10


def new_optimizer(cls, params, model):
    p = {k: v for k, v in params.items() if k in inspect.signature(cls.__init__).parameters}
    return cls(model.parameters(), **p)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.ReLU(),
                               torch.nn.Linear(H, D_OUT))


def state_values(optimizer):
    out = []
    sd = optimizer.state_dict()
    for group in sd["param_groups"]:
        for pid in group["params"]:
            for k, v in sorted(sd["state"].get(pid, {}).items()):
                out.append((k, v.clone() if torch.is_tensor(v) else v))
    return out


def test_broadcast_state():
    c, rank = Checks(), hvd.rank()
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)  # different on every rank
    for (name, cls), params in itertools.product(OPTIMIZERS, OPT_PARAMS):
        model = mlp()
        opt = hvd.DistributedOptimizer(new_optimizer(cls, params, model),
                                       named_parameters=model.named_parameters())
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        model_values = [(k, v.clone()) for k, v in sorted(model.state_dict().items())]
        for k, v in model_values:
            hvd.broadcast_(v, root_rank=0, name=k)
        opt_values = []
        for k, v in state_values(opt):
            if torch.is_tensor(v):
                hvd.broadcast_(v, root_rank=0, name=f"{k}_tensor")
            else:
                v = hvd.broadcast_object(v, name=k)
            opt_values.append((k, v))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "state.pt")
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            model = mlp()
            opt = hvd.DistributedOptimizer(new_optimizer(cls, params, model),
                                           named_parameters=model.named_parameters())
            if rank == 0:
                ckpt = torch.load(path)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for (k, before), (k2, after) in zip(model_values, sorted(model.state_dict().items())):
            c.check(k == k2 and type(before) is type(after) and torch.equal(before, after),
                    f"{name}: parameter {k}")
        expected = hvd.broadcast_object(len(opt.state_dict()["state"]))
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        c.check(len(opt.state_dict()["state"]) == expected, f"{name}: state entries")
        for (k, before), (k2, after) in zip(opt_values, state_values(opt)):
            same = torch.equal(before, after) if torch.is_tensor(before) else before == after
            c.check(k == k2 and type(before) is type(after) and same, f"{name} {params}: {k}")
    c.done()


def test_broadcast_state_options():
    c, rank = Checks(), hvd.rank()
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)
    params_0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999),
                    etas=(0.8, 2.4), step_sizes=(1e-5, 100))
    params_1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9),
                    etas=(0.25, 1.75), step_sizes=(1e-7, 5))
    for name, cls in OPTIMIZERS:
        model = mlp()
        opt = hvd.DistributedOptimizer(new_optimizer(cls, params_0 if rank == 0 else params_1,
                                                     model),
                                       named_parameters=model.named_parameters())
        for _ in range(2):  # the options work in steps after the broadcast too
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        p0 = {k: v for k, v in params_0.items() if k in inspect.signature(cls.__init__).parameters}
        for k, want in p0.items():
            got = opt.param_groups[0][k]
            want, got = (list(want), list(got)) if isinstance(want, tuple) else ([want], [got])
            for a, b in zip(got, want):
                c.check(type(a) is type(b) and abs(a - b) <= 1e-5, f"{name}.{k}: {a} vs {b}")
    c.done()


def test_broadcast_state_no_grad():
    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    c = Checks()
    model = ModelNoGrad(torch.Tensor([1, 3]), torch.rand(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    c.check(opt.param_groups[0]["params"][0].grad is None, "no gradient for a frozen parameter")
    c.check(torch.all(torch.eq(grad, bgrad)).item(), "state creation made the same gradient")
    c.done()


def test_broadcast_and_allgather_object():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    expected = {"hello": 123, 0: [1, 2]}
    c.check(hvd.broadcast_object(expected if rank == 0 else {}, root_rank=0) == expected,
            "broadcast_object")
    c.check(hvd.broadcast_object(expected if rank == 0 else None, root_rank=0) == expected,
            "broadcast_object from None (Horovod's default name would differ)")
    d = {"metric_val_1": rank}
    if rank == 1:
        d["metric_val_2"] = 42
    want = [{"metric_val_1": i} for i in range(size)]
    if size > 1:
        want[1] = {"metric_val_1": 1, "metric_val_2": 42}
    c.check(hvd.allgather_object(d) == want, "allgather_object")
    c.done()


@needs_two
def test_broadcast_object_process_sets():
    from hvdtest import even_odd_sets, remove_sets

    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    expected = {"hello": 123, 0: [1, 2]}
    obj = expected if rank == ranks[0] else {}
    c.check(hvd.broadcast_object(obj, root_rank=ranks[0], process_set=this_set) == expected,
            "broadcast_object in a process set")
    remove_sets(sets)
    c.done()


def test_compression_fp16():
    c = Checks()
    fp16 = hvd.Compression.fp16
    for dtype in [torch.float32, torch.float64]:
        compressed, ctx = fp16.compress(torch.ones([5] * 3, dtype=dtype))
        c.check(compressed.dtype == torch.float16, "compressed dtype")
        back = fp16.decompress(compressed, ctx)
        c.check(back.dtype == dtype and np.linalg.norm(np.ones([5] * 3) - back.numpy()) < 1e-8,
                f"{dtype} round trip")
    for dtype in [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]:
        compressed, ctx = fp16.compress(torch.ones([5] * 3, dtype=dtype))
        back = fp16.decompress(compressed, ctx)
        c.check(compressed.dtype == dtype and back.dtype == dtype, f"{dtype} unchanged")
    c.done()


def test_optimizer_fp16_takes_the_wire():
    """DistributedOptimizer(compression=Compression.fp16) on float32
    parameters reduces through gradsync's float16 wire: every rank's
    gradient rounded to float16 once, summed in float32 in rank order,
    averaged, rounded once (tests/python/wire_ref.py's reference), not
    Horovod's cast-then-reduce in float16; the parameters stay identical on
    every rank. A float64 model keeps the cast (the wire takes float32)."""
    from wire_ref import wire_reference
    c = Checks()
    torch.manual_seed(1)
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # this rank's gradients from a copy without the optimizer's hooks (the
    # hooked model's are reduced in the background once backward runs), and
    # every rank's through the engine (an MPI call of our own on this thread
    # could meet the engine's thread inside MPI)
    gen = torch.Generator().manual_seed(10 + hvd.rank())
    x = torch.randn(N, D_IN, generator=gen) * 3
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), torch.zeros(N, D_OUT)).backward()
    mine = [p.grad.detach().clone().numpy() for p in plain.parameters()]
    every = hvd.allgather_object(mine)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    c.check(opt.wire == "float16" and opt.compression is None, "fp16 maps to the wire")
    F.mse_loss(model(x), torch.zeros(N, D_OUT)).backward()
    opt.synchronize()
    for k, p in enumerate(model.parameters()):
        ref = wire_reference([every[q][k].ravel() for q in range(hvd.size())], "float16",
                             "average") if hvd.size() > 1 else mine[k].ravel()  # 1: nothing sent
        got = p.grad.detach().numpy().ravel()
        c.check(np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"parameter {k}")
    with opt.skip_synchronize():
        opt.step()
    model64 = mlp().double()
    opt64 = hvd.DistributedOptimizer(torch.optim.SGD(model64.parameters(), lr=0.1),
                                     named_parameters=model64.named_parameters(),
                                     compression=hvd.Compression.fp16)
    c.check(opt64.wire is None and opt64.compression is not None, "float64 keeps the cast")
    c.done()


@needs_two
def test_force_allreduce():
    """Rank 0's loss uses fc1 and fc2 only, the others' all three layers: the
    optimizer still reduces every gradient (fc3's counts as zero on rank 0)
    and the parameters stay identical on every rank."""
    c, rank = Checks(), hvd.rank()
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(D_IN, H)
            self.fc2 = torch.nn.Linear(H, D_OUT)
            self.fc3 = torch.nn.Linear(D_OUT, D_OUT)

        def forward(self, x_):
            x1 = self.fc2(F.relu(self.fc1(x_)))
            return x1, self.fc3(F.relu(x1))

    for (name, cls), params in itertools.product(OPTIMIZERS, OPT_PARAMS):
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(new_optimizer(cls, params, model),
                                       named_parameters=model.named_parameters())
        y1, y2 = model(x)
        loss = F.mse_loss(y1 if rank == 0 else y2, y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        c.check(torch.equal(hvd.broadcast(flat, 0), flat), f"{name}: ranks differ")
    c.done()


@needs_two
def test_dynamic_requires_grad():
    c = Checks()
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    inp = torch.rand([1, 1, 100, 100])
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=gen.named_parameters())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())

    def train_step(train_generator=False, train_discriminator=False):
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        for p in gen.parameters():
            c.check(train_generator == (p.grad is not None and p.grad.max().is_nonzero()),
                    "generator gradient")
        for p in disc.parameters():
            c.check(train_discriminator == (p.grad is not None and p.grad.max().is_nonzero()),
                    "discriminator gradient")
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    for _ in range(10):
        train_step(train_generator=True)
        train_step(train_discriminator=True)
    c.done()


@needs_two
def test_gradient_clipping():
    c = Checks()
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = torch.nn.Parameter(torch.zeros(1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.ones(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = model.weight.grad.item()
    c.check(abs(prior) > abs(clipped), f"{prior} vs {clipped}")
    with opt.skip_synchronize():
        opt.step()
    c.check(abs(model.weight.item() - (0.5 - 0.1 * clipped)) < 1e-7, "step used the clipped grad")
    c.done()


@needs_two
def test_synchronize_step_warning():
    c = Checks()
    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    c.check(len(ws) == 1 and "optimizer.step() called without optimizer.skip_synchronize()"
            in str(ws[0].message), [str(w.message) for w in ws])
    c.done()


def test_named_parameters_checks():
    c = Checks()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # no names
    model(torch.rand([1, 1, 30, 30])).sum().backward()
    opt.step()
    c.raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=list(model.named_parameters())[0:1]), "missing names")
    net1, net2 = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    c.raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1),
        named_parameters=itertools.chain(net1.named_parameters(), net2.named_parameters())),
        "duplicate names")
    seq = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": seq[0].parameters()}, {"params": seq[1].parameters()}], lr=0.001))
    names = opt._parameter_names
    c.check(len(names) == len(set(names.values())), "unique generated names")
    all_names = hvd.allgather_object(set(names.values()))
    c.check(len(all_names) == hvd.size() and all(n == all_names[0] for n in all_names),
            "every rank generated the same names")
    c.check(isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD",
            "the optimizer is still an SGD")
    c.done()


@needs_two
def test_optimizer_process_sets():
    from hvdtest import even_odd_sets, remove_sets

    c, rank = Checks(), hvd.rank()
    (ranks, this_set), sets = even_odd_sets()
    even_set = sets[0]
    torch.manual_seed(rank)
    x, y = torch.randn(N, D_IN), torch.randn(N, D_OUT)
    model = mlp()
    opt = hvd.DistributedOptimizer(new_optimizer(torch.optim.SGD, OPT_PARAMS[0], model),
                                   named_parameters=model.named_parameters(),
                                   process_set=even_set)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()
    v = model.state_dict()["2.weight"]
    all_v = hvd.allgather(v, process_set=this_set)
    for start in range(0, all_v.numel(), v.numel()):
        other = all_v.flatten()[start:start + v.numel()]
        if this_set is even_set:
            c.check(torch.allclose(v.flatten(), other), "even ranks agree")
        elif start // v.numel() != this_set.rank():
            c.check(not torch.allclose(v.flatten(), other), "odd ranks stepped locally")
    remove_sets(sets)
    c.done()


# ------------------------------------------------- training = one process

def _data(step, micro, rank, rows=4):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 2, generator=g, dtype=torch.float64))


def _net(seed=7):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


@pytest.mark.parametrize("passes,predivide", [(1, 1.0), (3, 1.0), (2, 4.0)])
def test_training_equals_one_process(passes, predivide):
    """Horovod's semantics: the k backward passes' gradients are summed
    (torch accumulates them into p.grad), then averaged over the ranks. One
    process computes the same with loss sum_m sum_r loss(r, m) / size."""
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    model, ref = _net(), _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes,
                                   gradient_predivide_factor=predivide)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        for m in range(passes):
            x, y = _data(step, m, rank)
            F.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(F.mse_loss(ref(xr), yr) for xr, yr in
                   (_data(step, m, r) for m in range(passes) for r in range(size))) / size
        loss.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        c.check(torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max().item())
    c.done()


def test_adasum_optimizer_identical_gradients():
    """op=Adasum combines the parameter changes; with the same data on every
    rank the changes are equal and Adasum(a, a, ...) = a: one process's step."""
    c = Checks()
    model, ref = _net(), _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(step, 0, 0)
        for o, net in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            F.mse_loss(net(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        c.check(torch.allclose(p, q, rtol=1e-6, atol=1e-9), (p - q).abs().max().item())
    c.done()


# ----------------------------------------------------------- SyncBatchNorm

def test_sync_batch_norm():
    """Horovod's test (on the CPU): each rank normalizes its sample with the
    statistics of every rank's; outputs, running statistics and gradients
    equal torch.nn.BatchNorm1d over the stacked batch."""
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    ts_list = [
        torch.stack([torch.tensor([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1],
                                   [r * 4, r * 4 + 1]]) for r in range(size)]),
        torch.stack([torch.tensor([[r + 1], [r * 2 + 1], [r * 3 + 1], [r * 4 + 1]])
                     for r in range(size)]),
    ]
    for ts in ts_list:
        if ts.shape[0] * ts.shape[2] < 2:
            continue  # one value per channel: no variance to normalize by
        sync_bn, bn = hvd.SyncBatchNorm(num_features=4), torch.nn.BatchNorm1d(num_features=4)
        ts = ts.float()
        ts1, ts2 = ts.clone().requires_grad_(), ts.clone().requires_grad_()
        out = sync_bn(ts1[rank].unsqueeze(0))
        ref = bn(ts2)
        c.check(torch.allclose(out, ref[rank].unsqueeze(0), 1e-6, 1e-5), "output")
        c.check(torch.allclose(sync_bn.running_mean, bn.running_mean, 1e-6), "running mean")
        c.check(torch.allclose(sync_bn.running_var, bn.running_var, 1e-6), "running var")
        out.sum().backward()
        ref.mean(dim=0).sum().backward()
        c.check(torch.allclose(hvd.allreduce(sync_bn.weight.grad, name="sync_bn.weight.grad"),
                               bn.weight.grad, 1e-6, 1e-5), "weight grad")
        c.check(torch.allclose(hvd.allreduce(sync_bn.bias.grad, name="sync_bn.bias.grad"),
                               bn.bias.grad, 1e-6, 1e-5), "bias grad")
        c.check(torch.allclose(hvd.allreduce(ts1.grad, name="ts1.grad"), ts2.grad, 1e-6, 1e-5),
                "input grad")
    c.done()
