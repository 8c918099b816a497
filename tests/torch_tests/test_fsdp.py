"""FSDP on the gradsync backend: a small transformer trained with FULL_SHARD
and SHARD_GRAD_OP (FSDP1), and with fully_shard (FSDP2), follows the loss
curve DDP on gradsync gives (which test_ddp.py ties to one process); the full
state dict gathered on every rank holds DDP's parameters; and a
torch.distributed.checkpoint save of the sharded state (FSDP1's and
fully_shard's) loads back into a fresh model exactly and trains on as the
saved one does. State dicts go through torch.distributed.checkpoint.state_dict,
the API that serves FSDP1, FSDP2 and DDP alike."""
import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import ShardingStrategy  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from gsutil import collectively  # noqa: E402

pytestmark = pytest.mark.mpi

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
VOCAB, DIM, SEQ, LOCAL_BATCH, STEPS = 50, 32, 8, 2, 3


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        # flat rows: a 3-D Linear returns a view of its 2-D product, and
        # fully_shard warns that an in-place op on a view skips its hook
        return self.head(h.reshape(-1, DIM))


def model0():
    torch.manual_seed(11)
    return TinyTransformer()


def step_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * SIZE, SEQ + 1), generator=g)
    mine = tokens[RANK * LOCAL_BATCH:(RANK + 1) * LOCAL_BATCH]
    return mine[:, :-1], mine[:, 1:]


def train(model, steps=STEPS):
    """Per step: the loss averaged over all ranks' batches."""
    # SGD: linear in the gradients, so the sharded and replicated runs differ
    # only by rounding (Adam turns gradients that are rounding noise into
    # full-size steps of either sign)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = step_batch(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


@pytest.fixture(scope="module")
def ddp_run(torch_pg):
    ddp = DDP(model0())
    losses = train(ddp)
    return losses, {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def leaves(model):
    return [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp_matches_ddp_loss(strategy, ddp_run):
    ref_losses, _ = ddp_run
    with collectively(what=strategy):
        model = model0()
        fsdp = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy),
                    auto_wrap_policy=lambda module, recurse, **kw: recurse or isinstance(
                        module, nn.TransformerEncoderLayer),
                    device_id=torch.device("cpu"), use_orig_params=True)
        losses = train(fsdp)
        assert ref_losses[0] > ref_losses[-1], "the reference does not learn"
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-4 * abs(b), f"{strategy} losses {losses} vs DDP {ref_losses}"


def test_fully_shard_matches_ddp_loss(ddp_run):
    from torch.distributed.fsdp import fully_shard
    ref_losses, _ = ddp_run
    with collectively():
        model = model0()
        for layer in leaves(model):
            fully_shard(layer)
        fully_shard(model)
        losses = train(model)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-4 * abs(b), f"fully_shard losses {losses} vs DDP {ref_losses}"


def test_full_state_dict_gathers_ddp_parameters(ddp_run):
    _, ref_state = ddp_run
    with collectively():
        fsdp = FSDP(model0(), sharding_strategy=ShardingStrategy.FULL_SHARD,
                    device_id=torch.device("cpu"))
        train(fsdp)
        # (cpu_offload on a CPU model fails inside FSDP with gloo too: torch
        # 2.13 frees the gathered storage it then reads)
        state = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
        assert set(state) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)


def fsdp1(model):
    return FSDP(model, device_id=torch.device("cpu"))


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard
    for layer in leaves(model):
        fully_shard(layer)
    return fully_shard(model)


@pytest.mark.parametrize("wrap", [fsdp1, fsdp2], ids=["FSDP", "fully_shard"])
def test_distributed_checkpoint_round_trip(wrap, torch_pg):
    name = [tempfile.mkdtemp(prefix="gs-dcp-") if RANK == 0 else None]
    dist.broadcast_object_list(name, src=0)
    path = name[0]
    try:
        with collectively():
            trained = wrap(model0())
            train(trained, steps=1)
            # the sharded state: each rank saves and loads only its shards
            dcp.save({"model": get_model_state_dict(trained)}, checkpoint_id=path)
            fresh = wrap(TinyTransformer())
            target = {"model": get_model_state_dict(fresh)}
            dcp.load(target, checkpoint_id=path)
            set_model_state_dict(fresh, target["model"])
            full = StateDictOptions(full_state_dict=True)
            want = get_model_state_dict(trained, options=full)
            got = get_model_state_dict(fresh, options=full)
            assert set(got) == set(want)
            for k, v in want.items():
                assert torch.equal(got[k], v), f"{k} differs after the checkpoint round trip"
            # and the restored model trains on as the saved one does (the
            # second step's loss follows the first step's update)
            assert train(fresh, steps=2) == train(trained, steps=2)
    finally:
        dist.barrier()
        if RANK == 0 and os.path.isdir(path):
            shutil.rmtree(path)
