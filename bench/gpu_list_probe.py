"""Where a fused list's time goes on the NCCL path (issue 50's session found
gradsync's ResNet-50 list 83x one flat torch NCCL call with 2 ranks sharing
one GPU): the same bytes as one tensor, as k equal tensors, as ResNet-50's
161, as torch tensors and as gradsync DeviceArrays, and torch.profiler's
table of one list call. Each figure: median seconds of one call and the
wait for its result (host clock after a device synchronize).

    mpiexec -n 2 python -m bench.gpu_list_probe [--repeats 5]
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import gradsync as gs
from bench.gpu import load_shapes

CUDA = torch.cuda.is_available()  # without: a dry run of the logic on the CPU
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, repeats, world):
    fn()
    sync()
    out = []
    for _ in range(repeats):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return world.allreduce(statistics.median(out), op=MPI.MAX)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    if CUDA:
        torch.cuda.set_device(0)
    comm = gs.Communicator()
    shapes = load_shapes("resnet50")[0]
    total = sum(int(np.prod(s)) for s in shapes)
    rows = []

    def put(name, seconds):
        rows.append((name, seconds))
        if world.rank == 0:
            print(f"{name:<48} {seconds * 1e3:9.3f} ms", flush=True)

    flat = torch.ones(total, device=DEV)
    put(f"gradsync 1 tensor of {total} floats", timed(lambda: comm.allreduce_(flat), args.repeats,
                                                        world))
    for k in (8, 32, 161):
        parts = list(torch.ones(total - total % k, device=DEV).chunk(k))
        put(f"gradsync {k} equal views of one tensor",
            timed(lambda p=parts: comm.allreduce_(p), args.repeats, world))
    grads = [torch.ones(s, device=DEV) for s in shapes]
    put("gradsync ResNet-50 list (161 torch tensors)",
        timed(lambda: comm.allreduce_(grads), args.repeats, world))
    if CUDA:
        arrays = [gs.to_device(np.ones(s, np.float32)) for s in shapes]
        put("gradsync ResNet-50 list (161 DeviceArrays)",
            timed(lambda: comm.allreduce_(arrays), args.repeats, world))
    small = [torch.ones(s, device=DEV) for s in shapes[:16]]
    put("gradsync first 16 ResNet-50 tensors", timed(lambda: comm.allreduce_(small), args.repeats,
                                                      world))
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        comm.allreduce_(grads)
        sync()
    if world.rank == 0:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14), flush=True)
        if CUDA:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
