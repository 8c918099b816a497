"""The PyTorch half of the gradsync demo (scripts/demo.py runs it when torch
imports; ``--backend numpy`` runs the NumPy MLP instead).

The same synthetic dataset and network shape as the NumPy demo, now a
``torch.nn`` MLP trained with ``gradsync.torch.DistributedOptimizer``:

    1. every rank draws DIFFERENT weights; broadcast_parameters(model, root=0)
       and broadcast_optimizer_state(opt, root=0) make them identical
    2. each step: forward/backward on the rank's own mini-batch; gradient hooks
       accumulate into float32 buckets and start each bucket's allreduce as soon
       as its gradients are in (overlapping the rest of backward)
    3. opt.step(): waits for the buckets, writes the averaged gradients, steps
       SGD with momentum, identical on every rank

It prints the loss and accuracy as it goes, and at the end what the
communication cost: gradsync's counters (comm.stats(): collectives, messages,
bytes) and the time spent waiting in synchronize().
"""
import hashlib
import time

import demo as base
import demo_model as dm
import numpy as np
import torch
from mpi4py import MPI

import gradsync as gs
import gradsync.torch as gst

N_CLASSES = base.N_CLASSES
N_IN = base.N_IN


def make_model(hidden, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(N_IN, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, N_CLASSES))


def digest(model):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.digest()


def digests(model):
    return MPI.COMM_WORLD.allgather(digest(model))


@torch.no_grad()
def evaluate(comm, model, x, y, buf):
    logits = model(x)
    loss_sum = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    correct = float((logits.argmax(1) == y).sum())
    buf[:] = (loss_sum, correct, len(y))
    comm.allreduce_(buf, op="sum")
    return buf[0] / buf[2], buf[1] / buf[2]


def stats_delta(after, before):
    return {k: after[k] - before[k] for k in after}


def train(comm, args):
    torch.set_num_threads(1)   # 4 ranks on 2 cores
    rank, size = comm.rank, comm.size
    root = rank == 0
    say = (lambda *a: print(*a, flush=True)) if root else (lambda *a: None)
    t_start = time.perf_counter()

    x_train, y_train, x_test, y_test = dm.make_dataset(args.seed, args.train_size,
                                                       args.test_size, n_in=N_IN,
                                                       n_classes=N_CLASSES)
    x_shard = torch.from_numpy(np.ascontiguousarray(x_train[rank::size]))
    y_shard = torch.from_numpy(y_train[rank::size])
    x_test = torch.from_numpy(np.ascontiguousarray(x_test[rank::size]))
    y_test = torch.from_numpy(y_test[rank::size])
    if len(y_shard) == 0:
        raise ValueError("rank %d has no training data (--train-size too small)" % rank)

    model = make_model(args.hidden, args.seed * 1000 + 1 + rank)   # different per rank
    K = args.backward_passes
    # Adasum: each rank steps on its own gradient and the changes are combined,
    # so it works with the learning rate of one rank (the paper's recipe)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = gst.DistributedOptimizer(inner, model.named_parameters(), op=args.op,
                                   backward_passes_per_step=K,
                                   bucket_bytes=args.bucket_kib * 1024, comm=comm)
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = 4 * n_params

    info = gs.build_info()
    say("gradsync demo: data-parallel PyTorch MLP (torch %s) on %d rank%s"
        % (torch.__version__, size, "" if size == 1 else "s"))
    say("  model   %d -> %d -> %d -> %d (ReLU, cross-entropy), %s parameters in %d tensors"
        % (N_IN, args.hidden, args.hidden, N_CLASSES, format(n_params, ","),
           len(list(model.parameters()))))
    say("  data    10-class Gaussian blobs, %s train / %s held-out, seed %d; "
        "%s train samples per rank"
        % (format(args.train_size, ","), format(args.test_size, ","), args.seed,
           format(len(y_shard), ",")))
    say("  batch   %d per rank x %d micro-batch%s x %d ranks = %d per step; SGD lr %g "
        "momentum %g; %d steps"
        % (args.batch, K, "" if K == 1 else "es", size, args.batch * K * size, args.lr,
           args.momentum, args.steps))
    say("  comm    DistributedOptimizer(op=%r): %d bucket%s of <= %s over %s of float32 "
        "gradients, each reduced asynchronously as soon as backward has filled it"
        % (args.op, len(opt.bucket_names()), "" if len(opt.bucket_names()) == 1 else "s",
           base.fmt_bytes(args.bucket_kib * 1024), base.fmt_bytes(grad_bytes)))
    say("  %s" % base.mpi_library_line(info))

    before = digests(model)
    t0 = time.perf_counter()
    gst.broadcast_parameters(model, root=0, comm=comm)
    gst.broadcast_optimizer_state(opt, root=0, comm=comm)
    t_bcast = time.perf_counter() - t0
    after = digests(model)
    ok = len(set(after)) == 1
    say("broadcast_parameters(model, root=0): %d distinct weight sets before, %d after "
        "(%.2f ms)%s" % (len(set(before)), len(set(after)), 1e3 * t_bcast,
                         "" if ok else "  <-- FAILED"))
    if not ok:
        return 1

    ebuf = np.zeros(3, dtype=np.float64)
    init_loss, init_acc = evaluate(comm, model, x_test, y_test, ebuf)
    say("step 0: held-out loss %.4f  acc %.1f%%" % (init_loss, 100 * init_acc))

    progress = base.Progress(args.steps, args.progress, args.log_every) if root else None
    mbuf = np.zeros(5, dtype=np.float64)
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    order, cursor = torch.randperm(len(y_shard), generator=g), 0
    stats0 = comm.stats()
    sync0 = opt.sync_seconds
    compute_s = 0.0
    window = [0.0, 0.0, 0, time.perf_counter()]
    failures = []

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss_sum = correct = n = 0.0
        sync_before = opt.sync_seconds
        for _ in range(K):
            if cursor + args.batch > len(order):
                order, cursor = torch.randperm(len(y_shard), generator=g), 0
            idx = order[cursor:cursor + args.batch]
            cursor += args.batch
            logits = model(x_shard[idx])
            loss = torch.nn.functional.cross_entropy(logits, y_shard[idx])
            loss.backward()                       # hooks fill buckets, start allreduces
            opt.step()                            # steps on the K-th micro-batch only
            opt.zero_grad()
            loss_sum += float(loss) * len(idx)
            correct += float((logits.argmax(1) == y_shard[idx]).sum())
            n += len(idx)
        t1 = time.perf_counter()
        sync_s = opt.sync_seconds - sync_before
        step_compute = (t1 - t0) - sync_s
        compute_s += step_compute
        mbuf[:] = (loss_sum, correct, n, step_compute, sync_s)
        comm.allreduce_(mbuf, op="sum")
        if root:
            window[0] += mbuf[3] / size
            window[1] += mbuf[4] / size
            window[2] += 1
            now = time.perf_counter()
            if progress.bar or step % progress.every == 0 or step in (1, args.steps):
                w = window[2]
                progress.update(step, mbuf[0] / mbuf[2], mbuf[1] / mbuf[2],
                                1e3 * window[0] / w, 1e3 * window[1] / w,
                                w / max(now - window[3], 1e-9))
                window[:] = [0.0, 0.0, 0, now]
        if args.check_every and step % args.check_every == 0 and step != args.steps:
            loss, acc = evaluate(comm, model, x_test, y_test, ebuf)
            same = len(set(digests(model))) == 1
            if not same:
                failures.append(step)
            if root:
                progress.message("  check @ step %d: held-out loss %.4f  acc %.1f%%  "
                                 "weights identical: %s"
                                 % (step, loss, 100 * acc, "yes" if same else "NO"))
                window[3] = time.perf_counter()
    if root:
        progress.close()

    st = stats_delta(comm.stats(), stats0)
    sync_s = opt.sync_seconds - sync0
    final_loss, final_acc = evaluate(comm, model, x_test, y_test, ebuf)
    final = digests(model)
    identical = len(set(final)) == 1
    wall = time.perf_counter() - t_start
    tot = comm.allreduce(np.array([compute_s, sync_s], dtype=np.float64), op="average")
    loss_ok = bool(np.isfinite(final_loss)) and final_loss < args.min_loss_ratio * init_loss
    if root:
        steps = args.steps
        c, s = tot
        say("")
        say("== summary (%d rank%s, %d steps, %.1f s wall) =="
            % (size, "" if size == 1 else "s", steps, wall))
        say("held-out loss     %.4f -> %.4f  (x%.3f, must be < x%g)   accuracy %.1f%% -> %.1f%%"
            % (init_loss, final_loss, final_loss / init_loss, args.min_loss_ratio,
               100 * init_acc, 100 * final_acc))
        say("compute           %7.2f s total  %6.2f ms/step  (forward, backward with the "
            "hooks' accumulation, optimizer%s)"
            % (c, 1e3 * c / steps, "; for adasum also the blocking Adasum of the parameter "
               "changes in step()" if args.op == "adasum" else ""))
        say("synchronize()     %7.2f s total  %6.2f ms/step  (waiting for the bucket "
            "allreduces left after backward)" % (s, 1e3 * s / steps))
        say("gradsync counters %d collectives, %d data messages, %s sent over %d steps "
            "(%.1f collectives/step, %s/step; includes the loss/accuracy sums)"
            % (st["calls"], st["messages"], base.fmt_bytes(st["bytes"]), steps,
               st["calls"] / steps, base.fmt_bytes(st["bytes"] / steps)))
        say("skipped steps     %d (non-finite gradients)" % opt.skipped_steps)
        say("gradsync %s  simd %s  |  %s"
            % (info.get("version", "?"), info.get("simd", "?"), base.mpi_library_line(info)))
        say("weights identical on all %d ranks: %s  (sha256 %s)"
            % (size, "yes" if identical else "NO", final[0].hex()[:16]))
        if failures:
            say("weights differed at checks after steps: %s" % failures)
        if not loss_ok:
            say("FAILED: held-out loss did not fall below %g x its initial value"
                % args.min_loss_ratio)
    return 0 if (identical and loss_ok and not failures) else 1
