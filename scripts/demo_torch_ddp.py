"""The torch.distributed half of the gradsync demo (``scripts/demo.py
--backend torch-ddp``; ``make demo DEMO_ARGS="--backend torch-ddp"``).

The same synthetic dataset and MLP as the other demos, trained the way
PyTorch users write it, with one line changed: the backend name.

    import gradsync.torch.distributed          # registers "gradsync"
    dist.init_process_group("gradsync")       # rank and size from MPI, no store
    model = DistributedDataParallel(model)    # buckets allreduced on gradsync

DDP broadcasts rank 0's weights at construction (every rank starts from a
different draw here, to show it), averages the gradients in buckets that
overlap the backward pass, and the demo checks at the end that every rank
holds bitwise-identical weights and that the held-out loss fell.
"""
import hashlib
import time

import demo as base
import demo_model as dm
import demo_torch
import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync as gs
import gradsync.torch.distributed  # noqa: F401  (registers the "gradsync" backend)


def digest(model):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.digest()


@torch.no_grad()
def evaluate(model, x, y):
    """Held-out (mean loss, accuracy) over every rank's shard (dist.all_reduce)."""
    logits = model(x)
    totals = torch.tensor([float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")),
                           float((logits.argmax(1) == y).sum()), float(len(y))],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def train(comm, args):
    torch.set_num_threads(1)  # 4 ranks on 2 cores
    dist.init_process_group("gradsync")
    rank, size = dist.get_rank(), dist.get_world_size()
    root = rank == 0
    say = (lambda *a: print(*a, flush=True)) if root else (lambda *a: None)
    x_train, y_train, x_test, y_test = dm.make_dataset(args.seed, args.train_size,
                                                       args.test_size, n_in=base.N_IN,
                                                       n_classes=base.N_CLASSES)
    x_shard = torch.from_numpy(np.ascontiguousarray(x_train[rank::size]))
    y_shard = torch.from_numpy(y_train[rank::size])
    x_test = torch.from_numpy(np.ascontiguousarray(x_test[rank::size]))
    y_test = torch.from_numpy(y_test[rank::size])

    model = demo_torch.make_model(args.hidden, args.seed * 1000 + 1 + rank)  # per rank
    before = MPI.COMM_WORLD.allgather(digest(model))
    bucket_mb = args.bucket_kib / 1024
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    after = MPI.COMM_WORLD.allgather(digest(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    say("gradsync demo: torch.distributed DDP on the gradsync backend, %d rank%s (torch %s)"
        % (size, "" if size == 1 else "s", torch.__version__))
    say("  init    dist.init_process_group(\"gradsync\"): rank and size from MPI, no store, "
        "no MASTER_ADDR")
    say("  model   %d -> %d -> %d -> %d MLP, %s parameters; DDP buckets of %s"
        % (base.N_IN, args.hidden, args.hidden, base.N_CLASSES,
           format(sum(p.numel() for p in model.parameters()), ","),
           base.fmt_bytes(args.bucket_kib * 1024)))
    say("  %s" % base.mpi_library_line(gs.build_info()))
    say("DDP(model): %d distinct weight sets before, %d after (rank 0's broadcast)"
        % (len(set(before)), len(set(after))))
    if len(set(after)) != 1:
        return 1

    init_loss, init_acc = evaluate(model, x_test, y_test)
    say("step 0: held-out loss %.4f  acc %.1f%%" % (init_loss, 100 * init_acc))
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    order, cursor = torch.randperm(len(y_shard), generator=g), 0
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        if cursor + args.batch > len(order):
            order, cursor = torch.randperm(len(y_shard), generator=g), 0
        idx = order[cursor:cursor + args.batch]
        cursor += args.batch
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x_shard[idx]), y_shard[idx])
        loss.backward()  # DDP's bucket allreduces run on gradsync during backward
        opt.step()
        if args.check_every and step % args.check_every == 0 and step < args.steps:
            held, acc = evaluate(model, x_test, y_test)
            say("step %d: held-out loss %.4f  acc %.1f%%" % (step, held, 100 * acc))
    elapsed = time.perf_counter() - t0
    final_loss, final_acc = evaluate(model, x_test, y_test)
    identical = len(set(MPI.COMM_WORLD.allgather(digest(model)))) == 1
    loss_ok = final_loss < args.min_loss_ratio * init_loss
    say("step %d: held-out loss %.4f  acc %.1f%%  (%.1f ms/step)"
        % (args.steps, final_loss, 100 * final_acc, 1e3 * elapsed / args.steps))
    say("weights bitwise identical on all %d ranks: %s" % (size, "yes" if identical else "NO"))
    say("held-out loss %.4f -> %.4f (%s %.2fx the initial)"
        % (init_loss, final_loss, "below" if loss_ok else "NOT below", args.min_loss_ratio))
    dist.destroy_process_group()
    return 0 if identical and loss_ok else 1
