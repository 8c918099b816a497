"""What the Horovod shim costs: the training step of
scripts/horovod/pytorch_synthetic_benchmark.py (its ResNet, SGD, synthetic
data) through gradsync.horovod.torch's DistributedOptimizer and through
gradsync.torch's own, alternating in one run (A B, B A, ...), median of
the per-round step times::

    mpiexec -n 2 python -m bench.horovod --rounds 9 --json horovod-bench.json

Both wrap the same optimizer over identical models; the shim adds Horovod's
argument handling and routes each bucket's allreduce through its ordered
engine (what makes join() and name checks work). Horovod's example is read
from the checkout's scripts/horovod, so this one runs from a checkout only.
"""
import argparse
import importlib.util
import os
import statistics
import time

import torch
import torch.nn.functional as F

import gradsync as gs
import gradsync.horovod.torch as hvd
import gradsync.torch as gst
from gradsync.bench.output import write_json

EXAMPLES = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", "..", "scripts",
                        "horovod")


def _example():
    path = os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py")
    spec = importlib.util.spec_from_file_location("pytorch_synthetic_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", help="write the figures here (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    example = _example()
    bargs = example.parser.parse_args(["--no-cuda", "--width", str(args.width), "--image-size",
                                       str(args.image_size), "--batch-size", str(args.batch_size)])
    comm = gs.Communicator()
    variants = {}
    for name in ("gradsync", "horovod"):
        model, data, target = example.build(bargs)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        if name == "gradsync":
            opt = gst.DistributedOptimizer(sgd, model.named_parameters(), comm=comm)
        else:
            opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        variants[name] = (model, opt, data, target)

    def step(name):
        model, opt, data, target = variants[name]
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    for name in variants:
        for _ in range(args.warmup):
            step(name)
    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    med = {name: statistics.median(t) for name, t in times.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
    ratios = [h / g for h, g in zip(times["horovod"], times["gradsync"])]
    params = sum(p.numel() for p in variants["gradsync"][0].parameters())
    result = {
        "ranks": hvd.size(), "params": params, "width": args.width,
        "image_size": args.image_size, "batch_size": args.batch_size, "steps": args.steps,
        "rounds": args.rounds, "threads": args.threads,
        "median_step_ms": {k: 1e3 * v for k, v in med.items()},
        "ratio_of_medians": med["horovod"] / med["gradsync"],
        "median_round_ratio": statistics.median(ratios),
        "median_cpu_ms": {k: 1e3 * v for k, v in cpu_med.items()},
        "cpu_ratio_of_medians": cpu_med["horovod"] / cpu_med["gradsync"],
        "step_ms": {k: [1e3 * x for x in v] for k, v in times.items()},
    }
    if hvd.rank() == 0:
        print(f"ResNet-18 layout, width {args.width}: {params / 1e6:.1f}M parameters, batch "
              f"{args.batch_size} at {args.image_size}x{args.image_size}, {hvd.size()} ranks, "
              f"{args.rounds} rounds of {args.steps} steps")
        for name in variants:
            print(f"  {name:9s} median step {1e3 * med[name]:8.1f} ms   rounds: " +
                  " ".join(f"{1e3 * x:.0f}" for x in times[name]))
        print(f"  shim / gradsync: {result['ratio_of_medians']:.3f} (ratio of medians), "
              f"{result['median_round_ratio']:.3f} (median of per-round ratios)")
        print(f"  process CPU time per step (both threads): gradsync "
              f"{1e3 * cpu_med['gradsync']:.1f} ms, shim {1e3 * cpu_med['horovod']:.1f} ms, "
              f"ratio {result['cpu_ratio_of_medians']:.3f}")
        if args.json:
            write_json(args.json, result)
    comm.close()


if __name__ == "__main__":
    main()
