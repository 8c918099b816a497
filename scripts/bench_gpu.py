"""GPU figures for docs/GPU.md, each a ratio against a baseline measured in the
same run (median of --repeats timed runs, CUDA events, after warm-up):

1. accumulate_ float32 += bfloat16 over 256M elements: achieved bandwidth as a
   fraction of a device-to-device copy's, and time against torch's acc.add_(grad).
2. accumulate_ over BERT-base's 199 gradients as one call, against a Python loop
   of torch add_ over the same tensors.
3. allreduce of ResNet-50's gradient list through gradsync (NCCL path) against
   torch.distributed with the NCCL backend (one bucket-free call per tensor and one
   flattened call), on the ranks given.

Run: mpiexec -n 1 python scripts/bench_gpu.py   (make gpu-test runs it)
"""
import argparse
import json
import os
import statistics

import numpy as np
import torch

import gradsync as gs
from gradsync.bench.data import load_shapes


def timed(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def accumulate_bandwidth(n, repeats):
    acc = torch.randn(n, device="cuda", dtype=torch.float32)
    grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(n, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), repeats)
    t_gs = timed(lambda: gs.accumulate_(acc, grad), repeats)
    t_torch = timed(lambda: acc.add_(grad), repeats)
    copy_bw = 2 * 4 * n / t_copy            # read + write
    gs_bw = (4 + 2 + 4) * n / t_gs          # read acc, read grad, write acc
    return {"elements": n, "copy_GBps": copy_bw / 1e9, "gradsync_GBps": gs_bw / 1e9,
            "fraction_of_copy": gs_bw / copy_bw, "torch_add_s": t_torch, "gradsync_s": t_gs,
            "speedup_vs_torch_add": t_torch / t_gs}


def accumulate_list(shapes, repeats):
    accs = [torch.randn(s, device="cuda") for s in shapes]
    grads = [torch.randn(s, device="cuda") for s in shapes]

    def loop():
        for a, g in zip(accs, grads):
            a.add_(g)

    t_loop = timed(loop, repeats)
    t_gs = timed(lambda: gs.accumulate_(accs, grads), repeats)
    return {"tensors": len(shapes), "loop_s": t_loop, "gradsync_s": t_gs,
            "speedup_vs_loop": t_loop / t_gs}


def allreduce_list(comm, shapes, repeats):
    import torch.distributed as dist
    grads = [torch.randn(s, device="cuda") for s in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    t_gs = timed(lambda: comm.allreduce_(grads), repeats)
    t_dist_loop = timed(lambda: [dist.all_reduce(g) for g in grads], repeats)
    t_dist_flat = timed(lambda: dist.all_reduce(flat), repeats)
    return {"tensors": len(shapes), "elements": int(flat.numel()), "gradsync_s": t_gs,
            "torch_dist_per_tensor_s": t_dist_loop, "torch_dist_flat_s": t_dist_flat,
            "ratio_vs_per_tensor": t_gs / t_dist_loop, "ratio_vs_flat": t_gs / t_dist_flat}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=256 * 2**20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    comm = gs.Communicator()
    torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import torch.distributed as dist
    dist.init_process_group("nccl", rank=comm.rank, world_size=comm.size)
    out = {"device": torch.cuda.get_device_name(), "ranks": comm.size,
           "build": {k: v for k, v in gs.build_info().items() if k != "mpi_library_version"}}
    out["accumulate_256M_f32_bf16"] = accumulate_bandwidth(args.elements, args.repeats)
    out["accumulate_bert_base"] = accumulate_list(
        load_shapes("bert_base")[0], args.repeats)
    out["allreduce_resnet50"] = allreduce_list(
        comm, load_shapes("resnet50")[0], args.repeats)
    dist.destroy_process_group()
    if comm.rank == 0:
        print(json.dumps(out, indent=2, default=float))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=float)
    comm.close()


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
