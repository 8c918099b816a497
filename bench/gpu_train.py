"""Figure (d) of bench.gpu: one training step of a ResNet-50 at
several ranks (on one GPU they share it, and gradsync takes the staged MPI
path), timed four ways in the same run, round by round so drift hits all
alike:

    compute    forward + backward + SGD step, no communication
    comm       gradsync's blocking fused allreduce of the 161 gradients alone
    gradsync   gradsync.torch.DistributedOptimizer (bucket allreduces start
               from the gradient hooks during backward)
    ddp-gloo   torch DistributedDataParallel over the gloo backend, on the
               same CUDA tensors

A step's time is the slowest rank's (max over ranks), the table the median
over the rounds. Then a few steps of each mode run under torch.profiler on
rank 0; trace_summary() reads the trace: how long backward's kernels keep the
compute stream busy, how long the other streams (the communication's copies
and kernels) are busy, and how much of that falls inside backward.
"""
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from gradsync.bench.timing import timed

STEP, BACKWARD = "gs_bench_step", "gs_bench_backward"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


# ------------------------------------------------------------------ the model

class Bottleneck(torch.nn.Module):
    """ResNet v1.5 bottleneck (stride on the 3x3), torchvision's names."""

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.conv1 = torch.nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3 = torch.nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(torch.nn.Module):
    """ResNet-50 (stages of 3, 4, 6, 3 bottlenecks). width=64 is the published
    model (25,557,032 parameters in 161 tensors, the list in
    gradient_shapes.json); a smaller width keeps the same layers for a dry run."""

    def __init__(self, width=64, classes=1000):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        cin = width
        for i, (blocks, stride) in enumerate(((3, 1), (4, 2), (6, 2), (3, 2))):
            w = width * 2 ** i
            layer = [Bottleneck(cin, w, stride)] + [Bottleneck(4 * w, w, 1)
                                                    for _ in range(blocks - 1)]
            setattr(self, f"layer{i + 1}", torch.nn.Sequential(*layer))
            cin = 4 * w
        self.fc = torch.nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---------------------------------------------------------------- the modes

class Mode:
    """One way of taking a training step; step() returns when the GPU is done."""

    def __init__(self, name, what, model, opt, loss_of, before=None):
        self.name, self.what, self.model, self.opt = name, what, model, opt
        self.loss_of, self.before = loss_of, before

    def step(self, sync):
        with torch.profiler.record_function(STEP):
            if self.before is not None:  # a mode without a model (comm alone)
                self.before()
            else:
                self.opt.zero_grad()
                loss = self.loss_of(self.model)
                with torch.profiler.record_function(BACKWARD):
                    loss.backward()
                self.opt.step()
            sync()


def make_modes(comm, dev, args, dist, gst):
    """The four modes, each with its own copy of the same initial model."""
    torch.manual_seed(1234)
    proto = ResNet50(args.width, args.classes)
    g = torch.Generator().manual_seed(99 + comm.rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g).to(dev)
    y = torch.randint(0, args.classes, (args.batch,), generator=g).to(dev)

    def loss_of(model):
        return F.cross_entropy(model(x), y)

    def copy():
        m = ResNet50(args.width, args.classes).to(dev)
        m.load_state_dict(proto.state_dict())
        return m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    modes = []
    m, o = copy()
    modes.append(Mode("compute", "forward+backward+step, no communication", m, o, loss_of))
    m, _ = copy()
    loss_of(m).backward()
    grads = [p.grad for p in m.parameters()]
    modes.append(Mode("comm", "gradsync blocking fused allreduce of the gradients alone",
                      m, None, loss_of,
                      before=lambda: comm.allreduce_(grads, op="average")))
    m, o = copy()
    o = gst.DistributedOptimizer(o, m.named_parameters(), comm=comm)
    modes.append(Mode("gradsync", "DistributedOptimizer, allreduces from backward's hooks",
                      m, o, loss_of))
    m, o = copy()
    ddp = torch.nn.parallel.DistributedDataParallel(
        m, device_ids=[dev.index] if dev.type == "cuda" else None)
    modes.append(Mode("ddp-gloo", "torch DDP, gloo backend, same CUDA tensors", ddp,
                      torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), loss_of))
    return modes


def _same_everywhere(world, model):
    """Whether the parameters are bitwise equal on every rank."""
    import hashlib
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return len(set(world.allgather(h.hexdigest()))) == 1


def _max_rel_diff(a, b):
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        d = (p.detach().double() - q.detach().double()).abs().max().item()
        s = q.detach().double().abs().max().item()
        worst = max(worst, d / s if s > 0 else d)
    return worst


def bench_training(comm, world, dev, args, dist, gst, log):
    """Times the modes, checks the replicas, profiles; returns a dict."""
    from mpi4py import MPI
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    modes = make_modes(comm, dev, args, dist, gst)
    times = {md.name: [] for md in modes}
    deadline = time.perf_counter() + args.max_seconds
    rounds = 0
    for it in range(args.warmup + args.iters):
        for md in modes:
            dt = timed(lambda: md.step(sync), world)
            if it >= args.warmup:
                times[md.name].append(dt)
        rounds += 1
        # a common decision: every rank leaves after the same round
        late = world.allreduce(time.perf_counter() > deadline, op=MPI.LOR)
        if it >= args.warmup + 2 and late:
            break
    by = {md.name: md for md in modes}
    out = {"ranks": comm.size, "device_transport": comm.device_transport,
           "batch_per_rank": args.batch, "image": args.image, "width": args.width,
           "parameters": sum(p.numel() for p in by["compute"].model.parameters()),
           "rounds": rounds, "timed_rounds": len(times["compute"]), "modes": {}}
    for md in modes:
        ts = times[md.name]
        out["modes"][md.name] = {"what": md.what, "median_s": statistics.median(ts),
                                 "min_s": min(ts), "max_s": max(ts), "samples_s": ts}
    med = {k: v["median_s"] for k, v in out["modes"].items()}
    c, m = med["compute"], med["comm"]
    for name in ("gradsync", "ddp-gloo"):
        out["modes"][name]["vs_compute"] = med[name] / c
        out["modes"][name]["share_of_comm_hidden"] = (c + m - med[name]) / m if m > 0 else None
    out["gradsync_vs_ddp_gloo"] = med["gradsync"] / med["ddp-gloo"]
    ddp_model = by["ddp-gloo"].model.module
    out["replicas_identical"] = {"gradsync": _same_everywhere(world, by["gradsync"].model),
                                 "ddp-gloo": _same_everywhere(world, ddp_model)}
    out["gradsync_vs_ddp_params_max_rel_diff"] = _max_rel_diff(by["gradsync"].model, ddp_model)
    if args.profile_steps > 0:
        out["trace"] = profile_modes(modes, world, dev, args, sync, log)
    return out


def profile_modes(modes, world, dev, args, sync, log):
    """A few steps of each mode under torch.profiler on rank 0 (the other
    ranks take the same steps unprofiled); returns each trace's summary."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    summaries = {}
    for md in modes:
        if md.name == "comm":
            continue
        path = os.path.join(args.trace_dir, f"trace_{md.name}.json")
        world.Barrier()
        if world.rank == 0:
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(args.profile_steps):
                    md.step(sync)
            prof.export_chrome_trace(path)
        else:
            for _ in range(args.profile_steps):
                md.step(sync)
        world.Barrier()
        if world.rank == 0:
            summaries[md.name] = trace_summary(path)
            summaries[md.name]["file"] = os.path.basename(path)
            log(f"profiled {md.name}: {path}")
    return summaries


# --------------------------------------------------------- reading a trace

def _union(intervals):
    """Sorted, merged copy of [(start, end)]."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(merged):
    return sum(e - s for s, e in merged)


def _clip(merged, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]


def _intersection(a, b):
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_summary(path):
    """Per profiled step (a 'gs_bench_step' range), from a Chrome trace that
    torch.profiler wrote: backward's kernels are those launched inside the
    'gs_bench_backward' range (matched through their correlation ids); the
    compute stream is the one they ran on longest; every GPU activity of the
    step on another stream is communication (gradsync's staged copies and
    kernels, gloo's copies). Medians over the steps, in milliseconds:

      backward_span_ms      first to last backward kernel on the compute stream
      backward_busy_ms      time the compute stream runs backward's work
      comm_busy_ms          time any other stream is busy
      comm_in_backward_ms   the part of comm_busy inside backward's span
      comm_overlap_share    comm_in_backward / comm_busy
      comm_lead_ms          how long before backward's end the communication
                            started (> 0: it began while backward ran)
      comm_tail_ms          how long after backward's end it went on
    """
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    steps, backwards, launch_ts, gpu = [], [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args") or {}
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if cat == "user_annotation" and e.get("name") == STEP:
            steps.append((ts, end))
        elif cat == "user_annotation" and e.get("name") == BACKWARD:
            backwards.append((ts, end))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launch_ts[args["correlation"]] = ts
        elif cat in GPU_CATS:
            gpu.append((ts, end, args.get("stream"), args.get("correlation")))
    rows = [_step_summary(st, backwards, launch_ts, gpu) for st in sorted(steps)]
    rows = [r for r in rows if r is not None]
    out = {"steps": len(steps), "steps_with_gpu_work": len(rows)}
    if rows:
        for key in rows[0]:
            vals = [r[key] for r in rows if r[key] is not None]
            out[key] = statistics.median(vals) if vals else None
    return out


def _step_summary(step, backwards, launch_ts, gpu):
    lo, hi = step
    bw = [b for b in backwards if lo <= b[0] and b[1] <= hi]
    mine = [g for g in gpu if lo <= g[0] and g[1] <= hi]
    if not bw or not mine:
        return None
    b_lo, b_hi = bw[0][0], bw[-1][1]
    back = [g for g in mine
            if g[3] in launch_ts and b_lo <= launch_ts[g[3]] <= b_hi]
    if not back:
        return None
    per_stream = {}
    for s, e, stream, _ in back:
        per_stream[stream] = per_stream.get(stream, 0.0) + (e - s)
    compute = max(per_stream, key=per_stream.get)
    back_busy = _union([(s, e) for s, e, st, _ in back if st == compute])
    span = (back_busy[0][0], back_busy[-1][1])
    comm = _union([(s, e) for s, e, st, _ in mine if st != compute])
    busy = _length(comm)
    inside = _length(_clip(comm, *span))
    ms = 1e-3  # trace times are microseconds
    return {
        "compute_stream": compute,
        "comm_streams": len({st for _, _, st, _ in mine if st != compute}),
        "backward_span_ms": (span[1] - span[0]) * ms,
        "backward_busy_ms": _length(back_busy) * ms,
        "comm_busy_ms": busy * ms,
        "comm_in_backward_ms": inside * ms,
        "comm_overlap_share": inside / busy if busy > 0 else None,
        "comm_overlaps_kernels_ms": _intersection(comm, back_busy) * ms,
        "comm_lead_ms": (span[1] - comm[0][0]) * ms if comm else None,
        "comm_tail_ms": max(0.0, comm[-1][1] - span[1]) * ms if comm else None,
    }
