"""The PyTorch backends of the demo: the same MLP shape as the NumPy one, a
``torch.nn`` model, every rank drawing DIFFERENT weights that replicate()
makes rank 0's.

``--backend torch`` (the default when torch imports): gradsync.torch's
DistributedOptimizer. Gradient hooks accumulate into float32 buckets and start
each bucket's allreduce as soon as its gradients are in (overlapping the rest
of backward); opt.step() waits for them and steps SGD with momentum,
identically on every rank. Its communication figure is the time step() waits
in synchronize(); the summary adds gradsync's counters (comm.stats()).

``--backend torch-ddp``: the way PyTorch users write it, one line changed,
the backend name::

    import gradsync.torch.distributed          # registers "gradsync"
    dist.init_process_group("gradsync")       # rank and size from MPI, no store
    model = DistributedDataParallel(model)    # buckets allreduced on gradsync

DDP broadcasts rank 0's weights at construction and averages the gradients
in buckets inside backward, so its communication is part of the compute
figure.
"""
import contextlib
import time

import torch
from demo_train import N_CLASSES, N_IN, fmt_bytes

import gradsync.torch as gst


class TorchMLP:
    """What both torch backends share: the model, its evaluation and weights."""

    def __init__(self, comm, args):
        torch.set_num_threads(1)   # 4 ranks on 2 cores
        self.comm, self.hidden = comm, args.hidden
        torch.manual_seed(args.seed * 1000 + 1 + comm.rank)   # different per rank
        self.model = torch.nn.Sequential(
            torch.nn.Linear(N_IN, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
            torch.nn.Linear(args.hidden, N_CLASSES))
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def model_line(self):
        return ("%d -> %d -> %d -> %d (ReLU, cross-entropy), %s parameters in %d tensors "
                "(torch %s)" % (N_IN, self.hidden, self.hidden, N_CLASSES,
                                format(self.n_params, ","), len(list(self.model.parameters())),
                                torch.__version__))

    def micro_batch(self, net, x, y):
        """Forward and backward of one micro-batch: (loss_sum, correct)."""
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        return float(loss.detach()) * len(y), float((logits.argmax(1) == y).sum())

    @torch.no_grad()
    def sums(self, x, y):
        logits = self.model(torch.from_numpy(x))
        y = torch.from_numpy(y)
        return (float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")),
                float((logits.argmax(1) == y).sum()))

    def weights(self):
        return [t.detach().contiguous().numpy() for t in self.model.state_dict().values()]

    def close(self):
        pass


class TorchOptimizer(TorchMLP):
    title = "data-parallel PyTorch MLP, gradsync.torch.DistributedOptimizer"
    comm_label = "waiting in synchronize()"

    def __init__(self, comm, args):
        super().__init__(comm, args)
        self.op, self.bucket_bytes = args.op, args.bucket_kib * 1024
        # Adasum: each rank steps on its own gradient and the changes are combined,
        # so it works with the learning rate of one rank (the paper's recipe)
        inner = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        self.wire = args.wire
        self.opt = gst.DistributedOptimizer(inner, self.model.named_parameters(), op=args.op,
                                            backward_passes_per_step=args.backward_passes,
                                            bucket_bytes=self.bucket_bytes, comm=comm,
                                            wire=args.wire)
        self.stats0 = comm.stats()

    def lines(self):
        n = len(self.opt.bucket_names())
        return [self.model_line(),
                "DistributedOptimizer(op=%r%s): %d bucket%s of <= %s over %s of float32 "
                "gradients, each reduced asynchronously as soon as backward has filled it"
                % (self.op, ", wire=%r with error feedback" % self.wire if self.wire else "",
                   n, "" if n == 1 else "s", fmt_bytes(self.bucket_bytes),
                   fmt_bytes(4 * self.n_params))]

    def replicate(self):
        gst.broadcast_parameters(self.model, root=0, comm=self.comm)
        gst.broadcast_optimizer_state(self.opt, root=0, comm=self.comm)
        return "broadcast_parameters(model, root=0)"

    def step(self, batches):
        t0, sync0 = time.perf_counter(), self.opt.sync_seconds
        loss_sum = correct = 0.0
        for x, y in batches:
            loss, right = self.micro_batch(self.model, x, y)   # hooks start the allreduces
            self.opt.step()                       # steps on the last micro-batch only
            self.opt.zero_grad()
            loss_sum, correct = loss_sum + loss, correct + right
        sync_s = self.opt.sync_seconds - sync0
        return loss_sum, correct, time.perf_counter() - t0 - sync_s, sync_s

    def summary(self, steps, comm_s):
        st = {k: v - self.stats0[k] for k, v in self.comm.stats().items()}
        return ["gradsync counters %d collectives, %d data messages (%s) and %d small calls "
                "reduced inside their validation exchange, over %d steps (%.1f collectives/step; "
                "includes the loss/accuracy sums)"
                % (st["calls"], st["messages"], fmt_bytes(st["bytes"]), st["rode_in_check"],
                   steps, st["calls"] / steps),
                "skipped steps     %d (non-finite gradients)%s"
                % (self.opt.skipped_steps, "; adasum: compute includes the blocking Adasum "
                   "of the parameter changes in step()" if self.op == "adasum" else "")]


class TorchDDP(TorchMLP):
    title = "torch.distributed DDP on the gradsync backend"
    comm_label = "gradient wait after backward (DDP reduces during it)"

    def __init__(self, comm, args):
        import torch.distributed as dist

        import gradsync.torch.distributed  # noqa: F401  (registers the "gradsync" backend)

        super().__init__(comm, args)
        self.dist, self.bucket_kib = dist, args.bucket_kib
        self.sgd = dict(lr=args.lr, momentum=args.momentum)
        self.wire = args.wire
        dist.init_process_group("gradsync")

    def lines(self):
        return [self.model_line(),
                "dist.init_process_group(\"gradsync\"): rank and size from MPI, no store, no "
                "MASTER_ADDR; DDP buckets of %s" % fmt_bytes(self.bucket_kib * 1024)]

    def replicate(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.ddp = DDP(self.model, bucket_cap_mb=self.bucket_kib / 1024)
        if self.wire:
            from gradsync.torch.distributed.hooks import WireState, wire_hook
            self.ddp.register_comm_hook(WireState(self.wire), wire_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), **self.sgd)
        return "DistributedDataParallel(model)"

    def step(self, batches):
        t0 = time.perf_counter()
        loss_sum = correct = 0.0
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss, right = self.micro_batch(self.ddp, x, y)   # bucket allreduces run here
            loss_sum, correct = loss_sum + loss, correct + right
        self.opt.step()
        self.opt.zero_grad()
        return loss_sum, correct, time.perf_counter() - t0, 0.0

    def summary(self, steps, comm_s):
        return []

    def close(self):
        self.dist.destroy_process_group()
