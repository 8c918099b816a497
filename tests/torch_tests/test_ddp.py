"""DistributedDataParallel on the gradsync backend gives the parameters that
one process gets training on the concatenated batch (every rank computes that
reference itself, without communication): many small buckets, gradients as
bucket views, the allreduce and fp16/bf16 compression comm hooks, no_sync
gradient accumulation, find_unused_parameters with a branch that some steps
skip, and a static graph."""
import copy

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from gradsync.torch.distributed.hooks import WireState, wire_hook  # noqa: E402
from gsutil import collectively  # noqa: E402

pytestmark = pytest.mark.mpi

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
LOCAL_BATCH = 3
STEPS = 4


class Net(nn.Module):
    """A small conv + MLP net; `skip` leaves the side branch unused."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 6 * 6, 33)
        self.side = nn.Linear(33, 33)
        self.fc2 = nn.Linear(33, 5)

    def forward(self, x, skip=False):
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.tanh(self.fc1(h))
        if not skip:
            h = h + self.side(h)
        return self.fc2(h)


def batches(step):
    """The whole step's batch (every rank draws the same one)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(LOCAL_BATCH * SIZE, 2, 6, 6, generator=g)
    y = torch.randn(LOCAL_BATCH * SIZE, 5, generator=g)
    return x, y


def mine(t):
    return t[RANK * LOCAL_BATCH:(RANK + 1) * LOCAL_BATCH]


def reference(model, steps, skip_on=(), micro=1):
    """One process on the concatenated batches (micro: batches per step)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batches(step * micro + m)
            loss = nn.functional.mse_loss(model(x, skip=step in skip_on), y) / micro
            loss.backward()
        opt.step()
    return model


def train(ddp, steps, skip_on=(), micro=1):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batches(step * micro + m)
            skip = step in skip_on
            if m < micro - 1:
                with ddp.no_sync():
                    (nn.functional.mse_loss(ddp(mine(x), skip=skip), mine(y)) / micro).backward()
            else:
                (nn.functional.mse_loss(ddp(mine(x), skip=skip), mine(y)) / micro).backward()
        opt.step()
    return ddp.module


def bf16_hook(group, bucket):
    """torch's bf16_compress_hook refuses to run without CUDA and NCCL; this is
    the same compression (divide, cast to bfloat16, allreduce, cast back) so
    the backend's bfloat16 allreduce inside a hook is tested on the CPU too."""
    buf = bucket.buffer()
    compressed = buf.div(dist.get_world_size(group)).to(torch.bfloat16)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buf.copy_(f.value()[0])
        return buf
    return fut.then(decompress)


def compare(got, ref, atol, what):
    worst = max((a - b).abs().max().item() for a, b in zip(got.parameters(), ref.parameters()))
    assert worst <= atol, f"{what}: parameters differ from one process by {worst:g}"


def fresh():
    torch.manual_seed(7)
    return Net()


CASES = {
    "default": dict(kw=dict(bucket_cap_mb=0.002), atol=2e-5),
    "grad_as_bucket_view": dict(kw=dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True),
                                atol=2e-5),
    "allreduce_hook": dict(kw={}, hook=default_hooks.allreduce_hook, atol=2e-5),
    "fp16_compress_hook": dict(kw={}, hook=default_hooks.fp16_compress_hook, atol=3e-3),
    "bf16_compress_hook": dict(kw={}, hook=default_hooks.bf16_compress_hook, atol=3e-2,
                               needs_cuda="torch's bf16 hook requires CUDA and NCCL"),
    "bf16_compression_in_a_hook": dict(kw={}, hook=bf16_hook, atol=3e-2),
    "static_graph": dict(kw=dict(static_graph=True), atol=2e-5),
    # gradsync's wire hook: float32 sums of each rank's shard sent in the
    # format, one rounding, error feedback per bucket
    "wire_hook_bfloat16": dict(kw={}, hook=wire_hook, state=lambda: WireState("bfloat16"),
                               atol=3e-2),
    "wire_hook_float8_e4m3": dict(kw={}, hook=wire_hook,
                                  state=lambda: WireState("float8_e4m3"), atol=1e-1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_one_process(case, torch_pg):
    spec = CASES[case]
    if spec.get("needs_cuda") and not torch.cuda.is_available():
        pytest.skip(spec["needs_cuda"])
    model = fresh()
    ref = reference(model, STEPS)
    with collectively(what=case):
        ddp = DDP(copy.deepcopy(model), **spec["kw"])
        if "hook" in spec:
            state = spec["state"]() if "state" in spec else dist.group.WORLD
            ddp.register_comm_hook(state, spec["hook"])
        trained = train(ddp, STEPS)
        compare(trained, ref, spec["atol"], case)
        # every rank holds the same parameters, bit for bit
        flat = torch.cat([p.detach().flatten() for p in trained.parameters()])
        same = MPI.COMM_WORLD.allgather(flat.numpy().tobytes())
        assert len(set(same)) == 1, f"{case}: the ranks' parameters differ"


def test_no_sync_accumulates_like_one_process(torch_pg):
    model = fresh()
    ref = reference(model, 2, micro=3)
    with collectively():
        compare(train(DDP(copy.deepcopy(model), bucket_cap_mb=0.002), 2, micro=3), ref, 2e-5,
                "no_sync")


def test_find_unused_parameters(torch_pg):
    model = fresh()
    skip_on = (1, 2)
    ref = reference(model, STEPS, skip_on=skip_on)
    with collectively():
        ddp = DDP(copy.deepcopy(model), find_unused_parameters=True, bucket_cap_mb=0.002)
        got = train(ddp, STEPS, skip_on=skip_on)
        compare(got, ref, 2e-5, "find_unused_parameters")


def test_buffers_and_parameters_broadcast_at_construction(torch_pg):
    torch.manual_seed(100 + RANK)  # every rank starts different
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with collectively():
        ddp = DDP(model)
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.state_dict().values()
                          if p.dtype.is_floating_point])
        gathered = [torch.empty_like(flat) for _ in range(SIZE)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), \
            "DDP did not broadcast rank 0's state"


def test_divergence_named_by_the_doctor(torch_pg, tmp_path_factory):
    """One injected divergence: the last rank all_reduces a metric of its
    own while the others run DDP's backward. Every rank raises (gradsync's
    cross-rank check; nothing hangs), every rank dumps its flight record, and
    the doctor's verdict names the rank, its call and this file's line."""
    import inspect
    import shutil

    import gradsync as gs
    from gradsync import doctor
    if SIZE < 2:
        pytest.skip("needs two ranks")
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("ddp-flight")) if RANK == 0 else None)
    gs.flight_record_dir(folder)
    gs.flight_stacks(True)
    torch.manual_seed(0)
    model = DDP(Net(), process_group=torch_pg)
    x, y = batches(0)
    late = SIZE - 1
    raised = None
    try:
        if RANK == late:
            my_line = inspect.currentframe().f_lineno + 1
            dist.all_reduce(torch.ones(3), group=torch_pg)
        else:
            loss = ((model(mine(x)) - mine(y)) ** 2).mean()
            my_line = inspect.currentframe().f_lineno + 1
            loss.backward()
    except Exception as e:  # noqa: BLE001 - DDP wraps the backend's error
        raised = e
    finally:
        gs.flight_stacks(False)
    lines = world.allgather(my_line)
    world.Barrier()
    rep = doctor.diagnose(folder) if RANK == 0 else None
    verdict = world.bcast((rep.code, rep.verdict) if rep else None)
    world.Barrier()
    if RANK == 0:
        shutil.rmtree(folder, ignore_errors=True)
    with collectively():
        assert raised is not None and "differs across ranks" in str(raised), raised
        code, text = verdict
        assert code == doctor.MISMATCH, text
        assert text.startswith("ranks disagree at call #"), text
        assert ("rank %d allreduce float32[3] sum at test_ddp.py:%d" % (late, lines[late])
                in text), text
        assert "at test_ddp.py:%d" % lines[0] in text, text
