"""Does DistributedOptimizer hide gradient communication behind backward?

    mpiexec -n 2 python -m bench.overlap [--batch 16] [--width 48] [--iters 7]

One training step of a small ResNet-style CNN on CPU (one torch thread per
rank), timed five ways in the same run, the ways interleaved round by round
so that drift hits all of them alike:

    compute   forward + backward + SGD step, no communication
    comm      one blocking fused comm.allreduce_(all grads, op="average") alone
    (a) gs-overlap   gradsync.torch.DistributedOptimizer: bucket allreduces start
                     from the gradient hooks during backward (--bucket-mib buckets)
    (a2) gs-1bucket  the same with buckets of 25 MiB (the default): for this model
                     one bucket, started when backward ends (hooks, no overlap)
    (b) gs-blocking  backward, then ONE blocking fused comm.allreduce_ of all
                     gradients, then the step
    (c) gloo-hooks   Horovod-style per-tensor averaging through torch.distributed
                     (gloo): each gradient's all_reduce(async_op=True) starts
                     from its hook, step() waits for all and divides by size

A step's time is the slowest rank's (max over ranks); the table gives the
median over --iters rounds (and the quartiles). With overlap working, (a)
sits closer to max(compute, comm) than to compute + comm. Timings only; no
assertions.
"""
import argparse
import os
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gradsync as gs  # noqa: E402
import gradsync.torch as gst  # noqa: E402
from bench.rendezvous import init_process_group  # noqa: E402
from gradsync.bench.timing import interleaved  # noqa: E402

WORLD = MPI.COMM_WORLD


# ------------------------------------------------------------------- model

class Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(cout)
        self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


class ResNetSmall(torch.nn.Module):
    """ResNet-18's shape at CIFAR scale, narrower: a stem, four stages of two
    basic blocks (width w, 2w, 4w, 8w), global pooling, a linear head."""

    def __init__(self, w=48, classes=10):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, w, 3, 1, 1, bias=False),
                                        torch.nn.BatchNorm2d(w), torch.nn.ReLU())
        layers, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(x.mean((2, 3)))


# ----------------------------------------------------------------- helpers

class GlooHooks:
    """Horovod's approach over torch.distributed: per-tensor async allreduce
    started from each gradient's hook; step() waits, averages, steps."""

    def __init__(self, model, opt):
        self.opt, self.pending = opt, []
        self.size = dist.get_world_size()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def step(self):
        for p, work in self.pending:
            work.wait()
            p.grad.div_(self.size)
        self.pending = []
        self.opt.step()


def make(args, seed=0):
    torch.manual_seed(seed)
    model = ResNetSmall(args.width)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16, help="images per rank (default 16)")
    p.add_argument("--image", type=int, default=32, help="image side (default 32)")
    p.add_argument("--width", type=int, default=48, help="first stage's channels (default 48)")
    p.add_argument("--iters", type=int, default=7, help="timed rounds (default 7, at least 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    p.add_argument("--bucket-mib", type=float, default=2.0,
                   help="DistributedOptimizer bucket size (default 2 MiB)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, size = WORLD.rank, WORLD.size
    comm = gs.Communicator()
    init_process_group(WORLD, "gloo")

    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def loss_of(model):
        return F.cross_entropy(model(x), y)

    m_compute, o_compute = make(args)
    m_comm, _ = make(args)
    loss_of(m_comm).backward()
    comm_grads = [q.grad for q in m_comm.parameters()]
    m_a, o_a = make(args)
    o_a = gst.DistributedOptimizer(o_a, m_a.named_parameters(),
                                   bucket_bytes=int(args.bucket_mib * 2**20), comm=comm)
    m_a2, o_a2 = make(args)
    o_a2 = gst.DistributedOptimizer(o_a2, m_a2.named_parameters(), comm=comm)
    m_b, o_b = make(args)
    grads_b = None
    m_c, o_c = make(args)
    o_c = GlooHooks(m_c, o_c)

    def step_compute():
        o_compute.zero_grad()
        loss_of(m_compute).backward()
        o_compute.step()

    def step_comm():
        comm.allreduce_(comm_grads, op="average")

    def step_a():
        o_a.zero_grad()
        loss_of(m_a).backward()
        o_a.step()

    def step_a2():
        o_a2.zero_grad()
        loss_of(m_a2).backward()
        o_a2.step()

    def step_b():
        nonlocal grads_b
        o_b.zero_grad(set_to_none=False)
        loss_of(m_b).backward()
        if grads_b is None:
            grads_b = [q.grad for q in m_b.parameters()]
        comm.allreduce_(grads_b, op="average")
        o_b.step()

    def step_c():
        o_c.opt.zero_grad()
        loss_of(m_c).backward()
        o_c.step()

    modes = [("compute", "forward+backward+step, no communication", step_compute),
             ("comm", "blocking fused allreduce_ of all gradients alone", step_comm),
             ("(a) gs-overlap", "DistributedOptimizer, bucket allreduces during backward",
              step_a),
             ("(a2) gs-1bucket", "DistributedOptimizer, 25 MiB buckets", step_a2),
             ("(b) gs-blocking", "backward, one blocking fused allreduce_, step", step_b),
             ("(c) gloo-hooks", "torch.distributed gloo, per-tensor async from hooks",
              step_c)]
    times = interleaved({name: fn for name, _, fn in modes}, WORLD, args.warmup,
                        max(args.iters, 5))

    n_params = sum(q.numel() for q in m_a.parameters())
    same = len(set(WORLD.allgather(
        b"".join(q.detach().numpy().tobytes() for q in m_a.parameters())))) == 1
    if rank == 0:
        med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        q = {k: (1e3 * float(np.percentile(v, 25)), 1e3 * float(np.percentile(v, 75)))
             for k, v in times.items()}
        info = gs.build_info()
        print("bench.overlap: %d ranks, ResNet-style CNN width %d, %s parameters (%.1f MiB "
              "float32 gradients in %d tensors), batch %d x %dx%d per rank, 1 torch thread "
              "per rank, %d cores; torch %s, %s"
              % (size, args.width, format(n_params, ","), 4 * n_params / 2**20,
                 len(list(m_a.parameters())), args.batch, args.image, args.image,
                 os.cpu_count(), torch.__version__, info["mpi_library"]))
        print("DistributedOptimizer: %d buckets of <= %.1f MiB"
              % (len(o_a.bucket_names()), args.bucket_mib))
        print("median of %d rounds (slowest rank per round), ms:" % len(times["compute"]))
        print("%-17s %9s %17s   %s" % ("mode", "median", "quartiles", "what"))
        for name, what, _ in modes:
            print("%-17s %9.1f %8.1f-%-8.1f   %s" % (name, med[name], q[name][0], q[name][1],
                                                    what))
        c, m = med["compute"], med["comm"]
        print("compute + comm    %9.1f" % (c + m))
        print("max(compute, comm)%9.1f" % max(c, m))
        for name in ("(a) gs-overlap", "(a2) gs-1bucket", "(b) gs-blocking",
                     "(c) gloo-hooks"):
            hidden = (c + m - med[name]) / m if m > 0 else float("nan")
            print("%-17s overhead over compute %+6.1f ms; share of comm hidden %5.0f%%"
                  % (name, med[name] - c, 100 * hidden))
        print("(a) ranks identical after %d steps: %s" % (len(times["compute"]) + args.warmup,
                                                         "yes" if same else "NO"))
    dist.destroy_process_group()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
