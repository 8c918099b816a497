"""bench.gpu's "wire" section: the wire allreduce's kernels on CUDA memory
(issue 32, item 5) over ResNet-50's 161 gradients at one rank, where the
exchanges are local copies and what is timed is the encode, reduce and
decode passes: each wire's time and its memory traffic's bandwidth as a
fraction of a float32 device-to-device copy's of the same list, measured in
the same run. Checked: the device's result has the host path's bits."""
import numpy as np
import torch

import gradsync as gs

WIRES = ("bfloat16", "float16", "float8_e4m3", "float8_e5m2")


def wire_bytes(wire):
    return 2.0 if wire in ("bfloat16", "float16") else 33.0 / 32.0


def host_check(comm, dev, wire):
    """One device call against the host path on the same values."""
    gen = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(4099, generator=gen, device=dev)
    h = x.cpu().numpy().copy()
    comm.allreduce_(h, wire=wire)
    comm.allreduce_(x, wire=wire)
    if x.is_cuda:
        torch.cuda.synchronize()
    same = np.array_equal(x.cpu().numpy().view(np.uint32), h.view(np.uint32))
    return "ok" if same else "device result differs from the host path's bits"


def bench_wire(comm, dev, shapes, clock):
    gen = torch.Generator(device=dev).manual_seed(5)
    grads = [torch.randn(s, generator=gen, device=dev) for s in shapes]
    n = sum(g.numel() for g in grads)
    flat, dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
    t_copy = clock.median(lambda: dst.copy_(flat))
    t_f32 = clock.median(lambda: comm.allreduce_(grads))
    out = {"ranks": comm.size, "tensors": len(shapes), "elements": n,
           "device_transport": comm.device_transport,
           "copy_s": t_copy, "copy_GBps": 8.0 * n / t_copy / 1e9, "float32_allreduce_s": t_f32}
    checks = []
    for wire in WIRES:
        ef = gs.ErrorFeedback()
        t = clock.median(lambda: comm.allreduce_(grads, wire=wire))
        t_ef = clock.median(lambda: comm.allreduce_(grads, wire=wire, residual=ef))
        wb = wire_bytes(wire)
        # encode: read 4, write wb; two local copies: 2 x (read + write wb);
        # reduce: read wb, write wb; decode: read wb, write 4
        traffic = (8.0 + 8.0 * wb) * n
        out[wire] = {"seconds": t, "seconds_error_feedback": t_ef, "vs_float32": t / t_f32,
                     "GBps": traffic / t / 1e9,
                     "fraction_of_copy_bandwidth": traffic / t / (8.0 * n / t_copy)}
        checks.append(host_check(comm, dev, wire))
    bad = [c for c in checks if c != "ok"]
    out["check"] = "ok" if not bad else bad[0]
    return out


def profile(wire="bfloat16", rounds=3):
    """Where a wire allreduce's time goes on the GPU: torch.profiler's
    kernel table over `rounds` calls on ResNet-50's list (one rank)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from gradsync.bench.data import load_shapes
    comm = gs.Communicator()
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(5)
    grads = [torch.randn(s, generator=gen, device=dev) for s in load_shapes("resnet50")[0]]
    for _ in range(2):
        comm.allreduce_(grads, wire=wire)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            comm.allreduce_(grads, wire=wire)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))
    comm.close()


if __name__ == "__main__":
    import sys
    profile(*(sys.argv[1:2] or ["bfloat16"]))
