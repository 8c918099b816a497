"""The gradsync torch.distributed backend against gloo, in the same run.

    mpiexec -n 2 python -m bench.torch_backend [--steps 15] [--json out.json]

Both backends live in one job: the default group is gradsync's (initialized
from torchrun-style variables, so a TCP store exists) and a second group over
the same ranks is gloo's (dist.new_group(backend="gloo")). Measurements are
interleaved round by round so that machine drift hits both alike; every
figure is the median over rounds of the slowest rank's time.

1. dist.all_reduce latency and bandwidth, float32, 4 B to 64 MiB
   (busbw = 2 (n-1)/n * bytes / time, as nccl-tests count it).
2. DDP training steps of a ResNet-style CNN (ResNet-18's shape at CIFAR
   scale, bench.overlap) and a small transformer encoder, one torch
   thread per rank:
     compute      forward + backward + SGD step without DDP
     ddp          the same step under DDP on the backend (25 MiB buckets)
     exposed      ddp - compute: the communication the step waits for
     collective   the gradients' bucket allreduces alone (DDP's buckets,
                  averaged, one after another): the communication itself
3. Per-call cost of a small dist.all_reduce (1 to 16384 floats, in place),
   gradsync's backend against the same call on a gs.Communicator (the
   backend's own cost is the difference: issue 46's goal is <= 5 us), gloo,
   and mpi4py's Allreduce on a NumPy array; also barrier. --only latency
   runs this part alone.
Timings only; nothing is asserted.
"""
import argparse
import os
import statistics

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradsync.torch.distributed  # noqa: E402,F401
from bench.overlap import ResNetSmall  # noqa: E402
from bench.rendezvous import init_process_group  # noqa: E402
from gradsync.bench.output import write_json  # noqa: E402
from gradsync.bench.timing import interleaved  # noqa: E402

WORLD = MPI.COMM_WORLD


class Transformer(nn.Module):
    """A small encoder-only language model (no dropout)."""

    def __init__(self, vocab=1000, dim=192, layers=4, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True),
            layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def init():
    """The default group on gradsync with a TCP store (so gloo can join)."""
    init_process_group(WORLD, "gradsync")
    return {"gloo": dist.new_group(backend="gloo"), "gradsync": dist.group.WORLD}


def allreduce_table(groups, rounds):
    rows = []
    nbytes = 4
    while nbytes <= 64 << 20:
        t = torch.ones(nbytes // 4)
        reps = max(1, min(200, (8 << 20) // nbytes))
        fns = {name: (lambda g=g: dist.all_reduce(t, group=g)) for name, g in groups.items()}
        times = interleaved(fns, WORLD, reps, rounds, reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        factor = 2 * (WORLD.size - 1) / WORLD.size
        rows.append({"bytes": nbytes, **{f"{k}_us": v * 1e6 for k, v in med.items()},
                     **{f"{k}_busbw_GBs": factor * nbytes / v / 1e9 for k, v in med.items()}})
        nbytes *= 4
    return rows


LATENCY_FLOATS = (1, 16, 256, 1024, 4096, 16384)


def latency_table(groups, rounds):
    """Microseconds per blocking call (median over rounds of the slowest
    rank's mean over a burst of calls), every candidate sampled in turn."""
    import numpy as np

    import gradsync as gs

    comm = gs.Communicator()
    rows = []
    for n in LATENCY_FLOATS:
        t, a = torch.ones(n), np.ones(n, np.float32)
        reps = 2000 if n <= 1024 else 500
        fns = {"mpi4py": lambda: WORLD.Allreduce(MPI.IN_PLACE, a),
               "communicator": lambda: comm.allreduce_(t),
               "gradsync": lambda: dist.all_reduce(t, group=groups["gradsync"]),
               "gloo": lambda: dist.all_reduce(t, group=groups["gloo"])}
        times = interleaved(fns, WORLD, 100, rounds, reps)
        rows.append({"floats": n, **{f"{k}_us": statistics.median(v) * 1e6
                                     for k, v in times.items()}})
    fns = {"communicator": comm.barrier,
           "gradsync": lambda: dist.barrier(group=groups["gradsync"]),
           "gloo": lambda: dist.barrier(group=groups["gloo"]), "mpi4py": WORLD.Barrier}
    times = interleaved(fns, WORLD, 100, rounds, 1000)
    rows.append({"floats": "barrier", **{f"{k}_us": statistics.median(v) * 1e6
                                         for k, v in times.items()}})
    comm.close()
    return rows


def print_latency(rows):
    print(f"blocking calls, {WORLD.size} ranks, us per call (median of rounds)")
    print(f"{'floats':>8} {'mpi4py':>8} {'gs.Comm':>8} {'backend':>8} {'gloo':>8} "
          f"{'backend-Comm':>13}")
    for r in rows:
        print(f"{r['floats']:>8} {r['mpi4py_us']:>8.1f} {r['communicator_us']:>8.1f} "
              f"{r['gradsync_us']:>8.1f} {r['gloo_us']:>8.1f} "
              f"{r['gradsync_us'] - r['communicator_us']:>13.1f}")


def model_rows(kind, groups, steps, batch):
    torch.manual_seed(0)
    if kind == "resnet":
        make = lambda: ResNetSmall(48)  # noqa: E731
        x = torch.randn(batch, 3, 32, 32)
        y = torch.randint(0, 10, (batch,))
        loss_of = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    else:
        make = lambda: Transformer()  # noqa: E731
        tokens = torch.randint(0, 1000, (batch, 65))
        loss_of = lambda m: F.cross_entropy(  # noqa: E731
            m(tokens[:, :-1]).reshape(-1, 1000), tokens[:, 1:].reshape(-1))
    base = make()
    models = {"compute": base}
    for name, g in groups.items():
        m = make()
        m.load_state_dict(base.state_dict())
        models[name] = DDP(m, process_group=g)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    grads = [p.detach().clone() for p in base.parameters()]
    buckets, cur, size = [], [], 0
    for t in reversed(grads):  # DDP's order: last layers first, 25 MiB buckets
        cur.append(t)
        size += t.numel() * 4
        if size >= 25 << 20:
            buckets.append(torch.cat([b.reshape(-1) for b in cur]))
            cur, size = [], 0
    if cur:
        buckets.append(torch.cat([b.reshape(-1) for b in cur]))

    def step(name):
        opts[name].zero_grad()
        loss_of(models[name]).backward()
        opts[name].step()

    def collective(g):
        for b in buckets:
            dist.all_reduce(b, op=dist.ReduceOp.AVG, group=g)

    fns = {name: (lambda name=name: step(name)) for name in models}
    fns.update({f"{name}_collective": (lambda g=g: collective(g)) for name, g in groups.items()})
    times = interleaved(fns, WORLD, 2, steps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"model": kind, "params": sum(p.numel() for p in base.parameters()),
           "buckets": len(buckets), "batch_per_rank": batch}
    out.update({f"{k}_ms": v for k, v in med.items()})
    for g in groups:
        out[f"{g}_exposed_ms"] = med[g] - med["compute"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15, help="timed training rounds (default 15)")
    p.add_argument("--rounds", type=int, default=7, help="timed allreduce rounds (default 7)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--only", choices=["latency"], help="run only this part")
    args = p.parse_args()
    torch.set_num_threads(1)
    groups = init()
    latency = latency_table(groups, args.rounds)
    if WORLD.rank == 0:
        print_latency(latency)
    if args.only == "latency":
        if WORLD.rank == 0 and args.json:
            write_json(args.json, {"ranks": WORLD.size, "torch": torch.__version__,
                                   "latency": latency})
        dist.destroy_process_group()
        return
    result = {"latency": latency, "ranks": WORLD.size, "torch": torch.__version__,
              "allreduce": allreduce_table(groups, args.rounds),
              "ddp": [model_rows("resnet", groups, args.steps, 16),
                      model_rows("transformer", groups, args.steps, 8)]}
    if WORLD.rank == 0:
        print(f"dist.all_reduce, float32, {WORLD.size} ranks (median of {args.rounds} rounds)")
        print(f"{'bytes':>10} {'gloo us':>10} {'gradsync us':>12} {'ratio':>6} "
              f"{'gloo GB/s':>10} {'gradsync GB/s':>14}")
        for r in result["allreduce"]:
            print(f"{r['bytes']:>10} {r['gloo_us']:>10.1f} {r['gradsync_us']:>12.1f} "
                  f"{r['gradsync_us'] / r['gloo_us']:>6.2f} {r['gloo_busbw_GBs']:>10.3f} "
                  f"{r['gradsync_busbw_GBs']:>14.3f}")
        for r in result["ddp"]:
            print(f"\nDDP {r['model']} ({r['params']} parameters, {r['buckets']} bucket(s), "
                  f"batch {r['batch_per_rank']} per rank), median of {args.steps} steps, ms:")
            print(f"  compute {r['compute_ms']:.1f}")
            for g in ("gloo", "gradsync"):
                print(f"  {g:>8}: step {r[g + '_ms']:.1f}  exposed {r[g + '_exposed_ms']:.1f}  "
                      f"collective {r[g + '_collective_ms']:.1f}")
            print(f"  gradsync/gloo: step {r['gradsync_ms'] / r['gloo_ms']:.2f}, collective "
                  f"{r['gradsync_collective_ms'] / r['gloo_collective_ms']:.2f}")
        if args.json:
            write_json(args.json, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
