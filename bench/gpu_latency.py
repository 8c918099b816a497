"""Section (e) of bench.gpu: small-message allreduce latency,
gradsync against torch.distributed in the same run (NCCL on GPUs, one per
rank; gloo on the CPU in a dry run).

gradsync's NCCL communicators are non-blocking (config.blocking = 0, so
that every wait polls, with timeouts and interrupts), and NCCL then does a
collective's host-side work on a thread it starts: this section measures
what that costs a latency-bound call. Each sample is one call and the wait
for its result on the host clock (gradsync's allreduce_ returns with the
result there; torch's all_reduce is followed by a synchronize of the current
stream, so both include the same host wait), the calls alternating between
the two libraries so that both see the same machine; the figure is the
median of many samples per size, 4 B to 1 MiB of float32.

    mpiexec -n 2 python -m bench.gpu --only latency --json latency.json
"""
import statistics
import time

import torch

SIZES = [4 << (2 * k) for k in range(10)]  # 4 B, 16 B, ..., 1 MiB
DRY_SIZES = SIZES[:6]  # up to 4 KiB


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def _check(comm, dev, n, dist, group):
    """Both libraries sum (rank + 1) over the ranks exactly (small integers
    in float32); None when both are right."""
    want = comm.size * (comm.size + 1) / 2
    a = torch.full((n,), float(comm.rank + 1), device=dev)
    b = a.clone()
    comm.allreduce_(a)
    dist.all_reduce(b, group=group)
    _sync(dev)
    bad = [name for name, t in (("gradsync", a), ("torch", b)) if not bool((t == want).all())]
    return f"{', '.join(bad)} differ from {want}" if bad else None


def _samples(comm, world, dev, n, dist, group, samples, warmup):
    """Per-call seconds, gradsync's and torch's, interleaved."""
    a = torch.zeros(n, device=dev)  # zeros stay zeros: no overflow over many calls
    b = torch.zeros(n, device=dev)

    def gs_call():
        comm.allreduce_(a)
        _sync(dev)

    def torch_call():
        dist.all_reduce(b, group=group)
        _sync(dev)

    for _ in range(warmup):
        gs_call()
        torch_call()
    t_gs, t_torch = [], []
    for _ in range(samples):
        for fn, out in ((gs_call, t_gs), (torch_call, t_torch)):
            world.Barrier()  # outside the timing: the ranks start each call together
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return t_gs, t_torch


def bench_latency(comm, world, dev, dist, group, dry_run, samples, warmup):
    """Median per-call latency by message size, and their ratio."""
    rows, bad = [], []
    for nbytes in DRY_SIZES if dry_run else SIZES:
        n = nbytes // 4
        check = _check(comm, dev, n, dist, group)
        if check:
            bad.append(f"{nbytes} B: {check}")
        world.Barrier()
        t_gs, t_torch = _samples(comm, world, dev, n, dist, group, samples, warmup)
        # the slowest rank's median: a collective is as fast as its last rank
        m_gs = world.allreduce(statistics.median(t_gs), op=_max())
        m_torch = world.allreduce(statistics.median(t_torch), op=_max())
        rows.append({"bytes": nbytes, "gradsync_us": 1e6 * m_gs, "torch_us": 1e6 * m_torch,
                     "ratio": m_gs / m_torch, "samples": len(t_gs)})
    return {"ranks": comm.size, "device_transport": comm.device_transport,
            "torch_backend": dist.get_backend(group), "sizes": rows,
            "check": "; ".join(bad) if bad else "ok"}


def _max():
    from mpi4py import MPI
    return MPI.MAX
