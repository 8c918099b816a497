"""GPU figures for docs/GPU.md (issue 13), each a ratio against a baseline
measured in the same run: the median of --repeats timed runs after warm-up,
timed with CUDA events on the current stream (host clock on the CPU).

  accumulate   gs.accumulate_ float32 += bfloat16 over 256M elements: its
               bandwidth (10 bytes per element) as a fraction of a float32
               device-to-device copy's (8 bytes per element; goal >= 0.85), and
               its time against torch acc.add_(grad.float()) (goal: faster) and
               torch's fused mixed-dtype acc.add_(grad).
  bert         gs.accumulate_ over BERT-base's 199 gradients in one call
               against a Python loop of torch add_ (and torch._foreach_add_),
               float32 += float32 and float32 += bfloat16.
  allreduce    gradsync's fused allreduce of ResNet-50's 161 gradients (NCCL
               path) against torch.distributed NCCL on the same tensors: one
               call per tensor, flatten + one call + unflatten, and one call on
               data already flat (goals: <= 1.05 against the per-tensor list,
               <= 1.1 against the flat call). Needs one GPU per rank, or
               NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1 (ranks share one).
  latency      allreduce latency from 4 B to 1 MiB, gradsync against
               torch.distributed NCCL in the same run, median of many calls
               (bench.gpu_latency; goal <= 1.05 at every size). 2+ ranks,
               GPUs as for allreduce.
  wire         the wire allreduce's kernels at one rank over ResNet-50's list
               (bench.gpu_wire): time per wire format and its bandwidth as a
               fraction of a device copy's.
  train        a ResNet-50 training step (bench.gpu_train):
               DistributedOptimizer vs torch DDP over gloo vs no
               communication, at 2+ ranks (on one GPU: the staged MPI path),
               with a torch.profiler trace summarised (overlap of the
               communication streams with backward's kernels).

    mpiexec -n 1 python -m bench.gpu --only accumulate,bert,allreduce --json a.json
    mpiexec -n 2 python -m bench.gpu --only train --json d.json --trace-dir traces
    mpiexec -n 2 python -m bench.gpu --only latency --json e.json
    python -m bench.gpu --dry-run          # CPU, tiny sizes: checks the logic

Every section checks its result (bitwise against torch where the arithmetic
is the same) and records "check": "ok" or what differed. Each section stops
repeating after --max-seconds. Results go to --json after each section, so a
run cut short keeps what it measured.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch

import gradsync as gs
from bench.gpu_figures import print_bench
from bench.rendezvous import init_process_group
from gradsync.bench.data import load_shapes
from gradsync.bench.output import write_json

SECTIONS = ("accumulate", "bert", "allreduce", "train", "latency", "wire")


# --------------------------------------------------------------- timing

class Clock:
    """Times a callable: CUDA events on the current stream (cuda), else the
    host clock. median() runs it `warmup` times, then up to `repeats` timed
    times, fewer if `max_seconds` pass (never fewer than 3)."""

    def __init__(self, dev, repeats, warmup, max_seconds):
        self.cuda = dev.type == "cuda"
        self.repeats, self.warmup, self.max_seconds = repeats, warmup, max_seconds

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn):
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    def samples(self, fn):
        for _ in range(self.warmup):
            fn()
        self.sync()
        out, t_end = [], time.perf_counter() + self.max_seconds
        while len(out) < self.repeats and (len(out) < 3 or time.perf_counter() < t_end):
            out.append(self.once(fn))
        return out

    def median(self, fn):
        return statistics.median(self.samples(fn))


def randn(shape, gen, dev, dtype=torch.float32):
    """Normal random values made on the device itself (256M on the host
    would take seconds of the lease)."""
    return torch.randn(shape, generator=gen, device=dev).to(dtype)


def first_difference(got, want):
    """None when bitwise equal, else a short description."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype == torch.bfloat16:
        got, want = got.view(torch.int16), want.view(torch.int16)
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    i = tuple(bad[0].tolist())
    return f"{bad.shape[0]} elements differ, first at {i}: {got[i].item()} vs {want[i].item()}"


# --------------------------------------------------------------- (a), (b)

def bench_accumulate(dev, n, clock):
    """accumulate_ float32 += bfloat16 over n elements."""
    gen = torch.Generator(device=dev).manual_seed(1)
    acc, grad = randn(n, gen, dev), randn(n, gen, dev, torch.bfloat16)
    src, dst = randn(n, gen, dev), torch.empty(n, device=dev)
    k = min(n, 1 << 20)  # bitwise check on a slice: torch adds in float32 too
    want = acc[:k] + grad[:k].float()
    got = acc[:k].clone()
    gs.accumulate_(got, grad[:k])
    check = first_difference(got, want)
    t_copy = clock.median(lambda: dst.copy_(src))
    t_gs = clock.median(lambda: gs.accumulate_(acc, grad))
    t_cast = clock.median(lambda: acc.add_(grad.float()))
    t_mixed = clock.median(lambda: acc.add_(grad))
    copy_bw, gs_bw = 8 * n / t_copy, 10 * n / t_gs
    return {"elements": n, "copy_s": t_copy, "gradsync_s": t_gs,
            "torch_add_cast_s": t_cast, "torch_add_mixed_s": t_mixed,
            "copy_GBps": copy_bw / 1e9, "gradsync_GBps": gs_bw / 1e9,
            "fraction_of_copy": gs_bw / copy_bw, "goal_fraction_of_copy": 0.85,
            "speedup_vs_torch_add_cast": t_cast / t_gs,
            "speedup_vs_torch_add_mixed": t_mixed / t_gs,
            "check": check or "ok"}


def bench_bert(dev, shapes, clock):
    """accumulate_ over a gradient list in one call against torch loops."""
    gen = torch.Generator(device=dev).manual_seed(2)
    out = {"tensors": len(shapes), "elements": int(sum(np.prod(s) for s in shapes))}
    for label, gdt in (("f32+=f32", torch.float32), ("f32+=bf16", torch.bfloat16)):
        accs = [randn(s, gen, dev) for s in shapes]
        grads = [randn(s, gen, dev, gdt) for s in shapes]
        want = [a + g.float() for a, g in zip(accs, grads)]
        got = [a.clone() for a in accs]
        gs.accumulate_(got, grads)
        bad = [(i, d) for i, d in enumerate(first_difference(x, y) for x, y in zip(got, want))
               if d]

        def loop(accs=accs, grads=grads):
            for a, g in zip(accs, grads):
                a.add_(g)

        t_loop = clock.median(loop)
        t_gs = clock.median(lambda a=accs, g=grads: gs.accumulate_(a, g))
        t_foreach = clock.median(lambda a=accs, g=grads: torch._foreach_add_(a, g))
        out[label] = {"torch_loop_s": t_loop, "gradsync_s": t_gs,
                      "torch_foreach_s": t_foreach, "speedup_vs_loop": t_loop / t_gs,
                      "speedup_vs_foreach": t_foreach / t_gs,
                      "check": "ok" if not bad else f"tensor {bad[0][0]}: {bad[0][1]}"}
    return out


# --------------------------------------------------------------- (c)

def bench_allreduce(comm, dev, shapes, clock, dist, group):
    """gradsync's fused allreduce of a gradient list against torch.distributed
    on the same tensors (NCCL on CUDA, gloo on the CPU)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    gen = torch.Generator(device=dev).manual_seed(3 + comm.rank)
    grads = [randn(s, gen, dev) for s in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    # check first: sum over ranks of integers in float32 is exact on any path
    ints = [torch.full(s, float(comm.rank + 1), device=dev) for s in shapes[:8]]
    comm.allreduce_(ints)
    want = comm.size * (comm.size + 1) / 2
    bad = [i for i, t in enumerate(ints) if not bool((t == want).all())]

    def per_tensor():
        for g in grads:
            dist.all_reduce(g, group=group)

    def pack_unpack():
        buf = _flatten_dense_tensors(grads)
        dist.all_reduce(buf, group=group)
        torch._foreach_copy_(grads, _unflatten_dense_tensors(buf, grads))

    t_gs = clock.median(lambda: comm.allreduce_(grads))
    t_list = clock.median(per_tensor)
    t_pack = clock.median(pack_unpack)
    t_flat = clock.median(lambda: dist.all_reduce(flat, group=group))
    return {"ranks": comm.size, "tensors": len(shapes), "elements": int(flat.numel()),
            "device_transport": comm.device_transport, "torch_backend": dist.get_backend(group),
            "gradsync_s": t_gs, "torch_per_tensor_s": t_list, "torch_pack_unpack_s": t_pack,
            "torch_flat_s": t_flat, "ratio_vs_per_tensor": t_gs / t_list,
            "ratio_vs_pack_unpack": t_gs / t_pack, "ratio_vs_flat": t_gs / t_flat,
            "goal_ratio_vs_per_tensor": 1.05,
            "check": "ok" if not bad else f"tensors {bad} differ from {want}"}


# --------------------------------------------------------------- plumbing

def environment(dev, comm):
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "ranks": comm.size, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "device": str(dev),
            "gradsync": {k: v for k, v in gs.build_info().items()
                         if k != "mpi_library_version"},
            "torch_has_dlpack_c_exchange_api": hasattr(torch.Tensor,
                                                       "__dlpack_c_exchange_api__"),
            "commit": os.environ.get("GS_COMMIT", "")}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_memory_GiB=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count, gpus_visible=torch.cuda.device_count())
        try:
            info["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - informational only
            info["torch_nccl"] = f"unknown ({exc})"
        try:
            import pynvml
            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - nvidia-smi reports it too
            info["driver"] = None
    return info


class Results:
    """The run's dictionary, written to --json (rank 0) after each section."""

    def __init__(self, path, rank):
        self.path, self.rank, self.data = path, rank, {}

    def put(self, key, value):
        self.data[key] = value
        if self.path and self.rank == 0:
            write_json(self.path, self.data)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None,
                   help="comma-separated sections of " + ",".join(SECTIONS) +
                   " (default: accumulate,bert,allreduce at 1 rank, train at more)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when torch sees one, else cpu (only with --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes and few repeats: checks the code paths, figures mean nothing")
    p.add_argument("--elements", type=int, default=256 * 2**20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop repeating a measurement (a training mode: a section) after this")
    p.add_argument("--json", help="write the results here (rank 0), after each section")
    p.add_argument("--trace-dir", default=".", help="where the training traces go")
    p.add_argument("--batch", type=int, default=32, help="train: images per rank")
    p.add_argument("--image", type=int, default=224, help="train: image side")
    p.add_argument("--width", type=int, default=64, help="train: ResNet width (64: ResNet-50)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=10, help="train: timed rounds")
    p.add_argument("--profile-steps", type=int, default=3, help="train: steps profiled per mode")
    args = p.parse_args(argv)
    if args.dry_run:
        args.elements = min(args.elements, 4099)
        args.repeats, args.warmup, args.max_seconds = 3, 1, min(args.max_seconds, 20.0)
        args.batch, args.image, args.width, args.classes = 2, 32, 4, 10
        args.iters, args.profile_steps = 3, 1
    return args


def shrink(shapes):
    """The same list with every dimension at most 3 (dry runs)."""
    return [tuple(min(d, 3) for d in s) for s in shapes]


def pick_device(args, comm):
    cuda = torch.cuda.is_available()
    kind = args.device or ("cuda" if cuda else "cpu")
    if kind == "cpu" and not args.dry_run:
        raise SystemExit("bench.gpu: no CUDA device (torch.cuda.is_available() is False); "
                         "--dry-run runs the logic on the CPU")
    if kind == "cuda":
        if not cuda:
            raise SystemExit("bench.gpu: --device cuda but torch sees no CUDA device")
        ordinal = comm.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(ordinal)
        return torch.device("cuda", ordinal)
    torch.set_num_threads(1)
    return torch.device("cpu")


def run(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    comm = gs.Communicator()
    dev = pick_device(args, comm)
    sections = args.only.split(",") if args.only else (
        ["accumulate", "bert", "allreduce"] if comm.size == 1 else ["train"])
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"bench.gpu: unknown sections {sorted(unknown)}; know {SECTIONS}")
    os.makedirs(args.trace_dir, exist_ok=True)
    res = Results(args.json, comm.rank)

    def log(msg):
        if comm.rank == 0:
            print(f"[bench.gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    init_process_group(world, "gloo")
    res.put("environment", environment(dev, comm))
    res.put("dry_run", args.dry_run)
    clock = Clock(dev, args.repeats, args.warmup, args.max_seconds)
    for name in sections:
        log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            value = section(name, args, comm, world, dev, clock, dist, log)
        except Exception as exc:  # noqa: BLE001 - one section's failure is a result too
            value = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name} FAILED: {value['error']}")
        if isinstance(value, dict):
            value["seconds"] = time.perf_counter() - t0
        res.put(name, value)
    if comm.rank == 0:
        print_bench(res.data)
    dist.destroy_process_group()
    comm.close()
    failed = [k for k in sections if "error" in res.data.get(k, {})
              or _bad_checks(res.data.get(k, {}))]
    return 1 if failed else 0


def section(name, args, comm, world, dev, clock, dist, log):
    local = comm.size == 1 or comm.rank == 0 or dev.type == "cpu"
    if name == "accumulate":
        return bench_accumulate(dev, args.elements, clock) if local else None
    if name == "bert":
        shapes = load_shapes("bert_base")[0]
        return bench_bert(dev, shrink(shapes) if args.dry_run else shapes, clock) \
            if local else None
    if name == "allreduce":
        shapes = load_shapes("resnet50")[0]
        shapes = shrink(shapes) if args.dry_run else shapes
        if not_enough_gpus(dev, comm):
            return {"skipped": not_enough_gpus(dev, comm)}
        group = dist.new_group(backend="nccl") if dev.type == "cuda" else None
        return bench_allreduce(comm, dev, shapes, clock, dist, group)
    if name == "wire":
        from bench.gpu_wire import bench_wire
        shapes = load_shapes("resnet50")[0]
        return bench_wire(comm, dev, shrink(shapes) if args.dry_run else shapes, clock) \
            if comm.size == 1 else {"skipped": "one rank: the kernels, not the exchange"}
    if name == "latency":
        if not_enough_gpus(dev, comm):
            return {"skipped": not_enough_gpus(dev, comm)}
        from bench.gpu_latency import bench_latency
        group = dist.new_group(backend="nccl") if dev.type == "cuda" else None
        return bench_latency(comm, world, dev, dist, group, args.dry_run,
                             samples=10 * args.repeats, warmup=10 * args.warmup)
    import gradsync.torch as gst
    from bench.gpu_train import bench_training
    return bench_training(comm, world, dev, args, dist, gst, log)


def not_enough_gpus(dev, comm):
    """Why NCCL cannot run this many ranks here, or None: one GPU per rank,
    unless NCCL 2.30+'s multi-rank-per-GPU mode is on (NCCL_MULTI_RANK_GPU_ENABLE=1,
    for gradsync's NCCL and torch's alike: issue 50's one-GPU sessions)."""
    if dev.type != "cuda" or comm.size <= torch.cuda.device_count() or \
            os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return None
    return (f"NCCL needs one GPU per rank (or NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL 2.30+): "
            f"{comm.size} ranks, {torch.cuda.device_count()} GPU(s)")


def _bad_checks(d):
    if not isinstance(d, dict):
        return False
    return any((k == "check" and v != "ok") or _bad_checks(v) for k, v in d.items())


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(run())
