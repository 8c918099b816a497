"""Benchmark of gradsync's gradient control kernels against NumPy, with the
machine's memory bandwidth measured in the same run (no MPI needed).

    python -m bench.kernels [--elements 64M] [--repeats 7]

Rows (median of --repeats; ratio = NumPy time / gradsync time):
  accumulate_ float32 += float16 on one 64M-element pair, vs NumPy `acc += grad`,
  and as a share of the copy bandwidth (a NumPy copy of the same bytes);
  accumulate_ over ResNet-50's gradient list (float32 += float16), one fused
  call vs a Python loop of NumPy `+=`; all_finite, zero_ and scale_ on the
  64M-element float32 array vs their NumPy equivalents.
"""
import argparse
import os

import numpy as np

import gradsync as gs
from gradsync.bench.args import parse_size
from gradsync.bench.data import load_shapes
from gradsync.bench.output import write_json
from gradsync.bench.timing import median_time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=parse_size, default=64 << 20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    n, r = args.elements, args.repeats
    rng = np.random.default_rng(0)
    acc = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32).astype(np.float16)
    rows = []

    def row(name, t_gs, t_base, base, extra=""):
        rows.append({"kernel": name, "gradsync_ms": t_gs * 1e3, "baseline": base,
                     "baseline_ms": t_base * 1e3, "speedup": t_base / t_gs, "note": extra})
        print(f"{name:44s} gradsync {t_gs * 1e3:9.2f} ms  {base:22s} {t_base * 1e3:9.2f} ms"
              f"  speedup {t_base / t_gs:6.2f}x  {extra}", flush=True)

    # Memory bandwidth: a NumPy copy moving as many bytes (read + write) as the
    # accumulate does (read 2 + 4, write 4 bytes per element).
    moved = n * (2 + 4 + 4)
    src = np.ones(moved // 16, dtype=np.float64)
    dst = np.empty_like(src)
    t_copy = median_time(lambda: np.copyto(dst, src), r)
    copy_bw = moved / t_copy
    t_gs = median_time(lambda: gs.accumulate_(acc, grad), r)
    t_np = median_time(lambda: np.add(acc, grad, out=acc, casting="unsafe"), r)
    row(f"accumulate_ f32 += f16, {n >> 20}M elements", t_gs, t_np, "numpy acc += grad",
        f"{moved / t_gs / 1e9:.1f} GB/s = {moved / t_gs / copy_bw * 100:.0f}% of copy "
        f"({copy_bw / 1e9:.1f} GB/s)")

    shapes = load_shapes("resnet50")[0]
    accs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [rng.standard_normal(s, dtype=np.float32).astype(np.float16) for s in shapes]

    def numpy_loop():
        for a, g in zip(accs, grads):
            a += g
    row(f"accumulate_ ResNet-50 list ({len(shapes)} tensors)",
        median_time(lambda: gs.accumulate_(accs, grads), r), median_time(numpy_loop, r),
        "python loop of +=")

    finite = np.ones(n, dtype=np.float32)
    row("all_finite f32", median_time(lambda: gs.all_finite(finite), r),
        median_time(lambda: bool(np.isfinite(finite).all()), r), "np.isfinite().all()")
    row("zero_ f32", median_time(lambda: gs.zero_(acc), r),
        median_time(lambda: acc.fill(0), r), "ndarray.fill(0)")
    row("scale_ f32", median_time(lambda: gs.scale_(acc, 0.5), r),
        median_time(lambda: np.multiply(acc, np.float32(0.5), out=acc), r), "np.multiply(out=)")
    info = gs.build_info()
    threads = os.environ.get("GRADSYNC_NUM_THREADS") or os.cpu_count()
    print(f"# simd {info['simd']}, threads {threads}"
          f", median of {r}, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, {"rows": rows, "build_info": info, "repeats": r})


if __name__ == "__main__":
    main()
