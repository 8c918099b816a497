#!/usr/bin/env python3
"""Probes for issue 30's defects on real hardware (scripts/gpu_session.sh
runs them on the device machine). Each probe runs in a child process under
a timeout, so a hang is a verdict ("hang"), not a stuck session:

  ring_held_front  a thread's all_finite waits on its result while the GPU
                   is busy; another thread's scale_ needs a table larger
                   than the kernel-table ring (item 1: used to spin forever
                   holding the ring lock, and then deadlock)
  ring_many        3000 small scale_ calls queued behind a busy GPU (item 1:
                   used to fail "ring is full of results not yet read")
  dead_stream      a CuPy side stream used by a gradsync call, then
                   destroyed; DeviceArrays allocated and freed afterwards
                   (item 3: they used that stream's handle)
  dlpack_stale     a DeviceArray written by a kernel still queued behind a
                   busy legacy default stream, read by torch on a side
                   stream through DLPack, and by CuPy through the CUDA array
                   interface (item 4: stale values)
  stray_context    a process that reduces only host memory creates no CUDA
                   context (NVML's list of compute processes)

Verdicts: ok, defect (the probe saw the bug: detail says what), hang,
crash, error (the probe itself failed), skipped (what it needs is missing).

    python scripts/gpu_probes.py [--json FILE] [--only a,b] [--dry-run]

--dry-run (no GPU, the emulated CUDA runtime): the GPU's busy-wait is the
emulated runtime's gate; probes that need torch or CuPy on a GPU skip.
"""
import argparse
import json
import os
import subprocess
import sys
import time

PROBES = ("ring_held_front", "ring_many", "dead_stream", "dlpack_stale", "stray_context")
SPIN_CYCLES = 4_000_000_000  # ~2 s at 2 GHz


# ------------------------------------------------------------------ in the child

class Busy:
    """Keeps the legacy default stream busy for a while: torch's busy-wait
    on the GPU (about 2 s), or the emulated runtime's gate, opened 1 s later
    by a timer (a busy-wait ends by itself, whatever the host does)."""

    def __init__(self):
        import ctypes
        self.lib = None
        try:
            lib = ctypes.CDLL("libgradsync.so")
            if getattr(lib, "gs_emulated_hold", None):
                lib.gs_emulated_hold.argtypes = [ctypes.c_size_t]
                self.lib = lib
        except OSError:
            pass
        if self.lib is None:
            import torch
            self.torch = torch

    def start(self):
        if self.lib is not None:
            import threading
            self.lib.gs_emulated_hold(1)
            threading.Timer(1.0, self.lib.gs_emulated_release).start()
        else:
            with self.torch.cuda.stream(self.torch.cuda.default_stream()):
                self.torch.cuda._sleep(SPIN_CYCLES)


def warm_up():
    """One small kernel call first: the process's first call allocates the
    kernel-table ring (pinned memory, whose allocation may synchronize the
    device), which would wait out the busy-wait and hide every ordering
    mistake the probes look for (seen on an H200, 2026-11-26: every probe
    passed on the old code until the ring was warmed up first)."""
    import numpy as np

    import gradsync as gs
    w = gs.to_device(np.ones(4, np.float32))
    gs.scale_([w], 1.0)
    gs.all_finite([w])


def probe_ring_held_front():
    import threading

    import numpy as np

    import gradsync as gs
    x = gs.to_device(np.ones(1 << 20, np.float32))
    # one table larger than the ring (1 MiB to start, and nothing has grown it)
    small = [gs.DeviceArray(1, np.float32) for _ in range(40000)]
    warm_up()
    busy = Busy()
    out = {}

    def run(key, fn):
        try:
            out[key] = fn()
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    busy.start()
    a = threading.Thread(target=run, args=("all_finite", lambda: gs.all_finite([x])), daemon=True)
    a.start()
    time.sleep(0.3)  # a probe, not a test: let A reach its wait behind the busy GPU
    b = threading.Thread(target=run, args=("scale_", lambda: gs.scale_(small, 0.5) is not None),
                         daemon=True)
    b.start()
    a.join(30)
    b.join(30)
    if a.is_alive() or b.is_alive():
        return "defect", ("still waiting after 30 s: "
                          f"all_finite {'stuck' if a.is_alive() else out.get('all_finite')}, "
                          f"scale_ {'stuck' if b.is_alive() else out.get('scale_')}")
    if out.get("all_finite") is not True or out.get("scale_") is not True:
        return "defect", f"results: {out}"
    return "ok", "both threads completed; all_finite True"


def probe_ring_many():
    import threading

    import numpy as np

    import gradsync as gs
    host = np.linspace(1, 2, 1000, dtype=np.float32)
    x = gs.to_device(host)
    nan = gs.to_device(np.array([1.0, np.nan], np.float32))
    warm_up()
    busy = Busy()
    busy.start()
    out = {}
    # a reader waiting for its result behind the busy GPU, as the launches queue
    reader = threading.Thread(target=lambda: out.update(finite=gs.all_finite([nan])), daemon=True)
    reader.start()
    time.sleep(0.3)
    n = 3000
    try:
        for i in range(n):
            gs.scale_([x], 2.0 if i % 2 else 0.5)  # exact: powers of two
    except Exception as exc:
        return "defect", f"call {i} of {n} failed: {type(exc).__name__}: {exc}"
    reader.join(30)
    if reader.is_alive() or out.get("finite") is not False:
        return "defect", f"the reader: {'stuck' if reader.is_alive() else out}"
    got = x.numpy()
    if not np.array_equal(got, host):
        return "defect", f"values changed: max diff {float(np.max(np.abs(got - host)))}"
    return "ok", f"{n} launches queued behind a busy stream and a waiting reader completed"


def probe_dead_stream():
    import gc

    import numpy as np

    import gradsync as gs
    try:
        import cupy
    except ImportError:
        return "skipped", "CuPy is not importable"
    warm_up()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        c = cupy.ones(1000, dtype=cupy.float32)
        gs.scale_([c], 2.0)  # its CAI stream becomes the call's work stream
    s.synchronize()
    ok = float(c.sum()) == 2000.0
    del c, s
    gc.collect()  # cudaStreamDestroy
    try:
        for _ in range(50):
            a = gs.DeviceArray(1 << 16, np.float32)
            del a
        b = gs.to_device(np.arange(10, dtype=np.float32))
        got = b.numpy()
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as exc:
        return "defect", f"after the stream was destroyed: {type(exc).__name__}: {exc}"
    if not ok or not np.array_equal(got, np.arange(10, dtype=np.float32)):
        return "defect", "wrong values"
    return "ok", "allocations after the stream's destruction used no dead stream"


def probe_dlpack_stale():
    import numpy as np

    import gradsync as gs
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no CUDA in torch")
    except ImportError as exc:
        return "skipped", f"torch on CUDA is needed: {exc}"
    n = 1 << 22
    warm_up()
    details, verdict = [], "ok"
    for consumer in ("torch-dlpack", "cupy-cai"):
        x = gs.to_device(np.ones(n, np.float32))
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(SPIN_CYCLES)  # the legacy default stream is busy
        gs.scale_([x], 2.0)  # queued there, behind the busy-wait
        if consumer == "torch-dlpack":
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                t = torch.from_dlpack(x)
                total = t.sum()
            side.synchronize()
            total = float(total)
        else:
            try:
                import cupy
            except ImportError:
                details.append("cupy-cai: skipped (no CuPy)")
                continue
            side = cupy.cuda.Stream(non_blocking=True)
            with side:
                total = cupy.asarray(x).sum()
            side.synchronize()
            total = float(total)
        torch.cuda.synchronize()
        if total != 2.0 * n:
            verdict = "defect"
            details.append(f"{consumer}: read {total:.0f}, want {2.0 * n:.0f} (stale)")
        else:
            details.append(f"{consumer}: ok")
    return verdict, "; ".join(details)


def probe_stray_context():
    import numpy as np

    import gradsync as gs
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:
        return "skipped", f"NVML (pynvml) is needed: {exc}"

    def listed():
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        return os.getpid() in pids

    c = gs.Communicator()
    c.allreduce(np.ones(4, np.float32))
    c.allreduce_([np.ones(1000, np.float64)])
    gs.scale_([np.ones(8, np.float32)], 2.0)
    a = gs.DeviceArray(16, np.float32, "cpu")
    gs.zero_([a])
    host_only = listed()
    pinned = gs.DeviceArray(16, np.float32, "cuda_host")  # needs a context: the control
    control = listed()
    del pinned
    c.close()
    if not control:
        return "skipped", "NVML does not list this process even with a context (PID namespace?)"
    if host_only:
        return "defect", "host-only calls created a CUDA context"
    return "ok", "no context until CUDA memory was asked for"


# ------------------------------------------------------------------ the parent

def run_one(name, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    mpiexec = os.environ.get("GS_PROBE_MPIEXEC")
    if mpiexec:
        cmd = [mpiexec, "-n", "1"] + cmd
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-800:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"verdict": "hang", "detail": f"no result within {timeout} s; stderr: {tail}",
                "seconds": round(time.time() - t0, 1)}
    result = {"verdict": "crash" if p.returncode < 0 else "error",
              "detail": f"rc {p.returncode}; stderr: {p.stderr[-1500:]}"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("PROBE "):
            result = json.loads(line[6:])
            break
    result["seconds"] = round(time.time() - t0, 1)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the verdicts here, after each probe")
    ap.add_argument("--only", help="comma-separated probe names")
    ap.add_argument("--timeout", type=float, default=45.0, help="seconds per probe")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: the emulated runtime's gate stands in for busy-waits")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            verdict, detail = globals()["probe_" + args.child]()
        except Exception as exc:
            verdict, detail = "error", f"{type(exc).__name__}: {exc}"
        print("PROBE " + json.dumps({"verdict": verdict, "detail": detail}), flush=True)
        os._exit(0)  # a thread still stuck must not keep the child alive
    names = args.only.split(",") if args.only else list(PROBES)
    results = {"dry_run": args.dry_run}
    for name in names:
        if name not in PROBES:
            ap.error(f"unknown probe {name!r}; probes: {', '.join(PROBES)}")
        results[name] = run_one(name, args.timeout)
        print(f"{name:16s} {results[name]['verdict']:8s} {results[name]['seconds']:6.1f}s  "
              f"{results[name]['detail'][:300]}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    bad = [n for n in names if results[n]["verdict"] in ("defect", "hang", "crash", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
