"""gsbench output: table header and rows, run metadata, summary, plot."""

import json
import os
import platform
import sys
import time

from gradsync.bench.args import HAS_INPLACE, REDUCING, busbw_factor
from gradsync.bench.baselines import baseline_columns


def fmt_num(v, width, spec):
    if v is None:
        return "n/a".rjust(width)
    return format(v, spec).rjust(width)


def header_lines(ctx, show_tensors):
    base = ctx.baseline == "mpi4py"
    left1 = "%12s %12s %9s %7s" % ("size", "count", "type", "redop")
    left2 = "%12s %12s %9s %7s" % ("(B)", "(elements)", "", "")
    if show_tensors:
        left1 += " %7s" % "tensors"
        left2 += " %7s" % ""
    blk1 = " %10s %8s %8s %6s" % ("time", "algbw", "busbw", "#wrong")
    blk2 = " %10s %8s %8s %6s" % ("(us)", "(GB/s)", "(GB/s)", "")
    if base:
        for _, title, ratio in baseline_columns(ctx):
            blk1 += " %10s %6s" % (title, "ratio")
            blk2 += " %10s %6s" % ("(us)", ratio)
    modes = [m for m in ctx.modes if m == "out-of-place" or ctx.collective in HAS_INPLACE]
    title = ""
    for m in modes:
        title += " " + m.center(len(blk1) - 1)
    return ["#" + " " * (len(left1) - 1) + title,
            "#" + left1[1:] + "".join(blk1 for _ in modes),
            "#" + left2[1:] + "".join(blk2 for _ in modes)]


def format_row(ctx, row, show_tensors):
    s = "%12d %12d %9s %7s" % (row["size"], row["count"], row["type"], row["op"])
    if show_tensors:
        s += " %7d" % row["tensors"]
    for key in ("oop", "ip"):
        if key not in row or row[key] is None:
            continue
        r = row[key]
        s += " " + fmt_num(r["time_us"], 10, ".2f")
        s += " " + fmt_num(r["algbw"], 8, ".3f")
        s += " " + fmt_num(r["busbw"], 8, ".3f")
        s += " " + ("%6d" % r["wrong"] if r["wrong"] is not None else "   N/A")
        if ctx.baseline == "mpi4py":
            for name, _, _ in baseline_columns(ctx):
                s += " " + fmt_num(r.get(name + "_us"), 10, ".2f")
                s += " " + fmt_num(r.get("ratio_" + name), 6, ".3f")
    return s


def ratio_summary(ctx, rows):
    """Summary lines of the baseline ratios (median, min, max over rows), per mode."""
    import statistics
    if ctx.baseline != "mpi4py":
        return []
    (k1, t1, _), (k2, t2, _) = baseline_columns(ctx)
    me = "adasum" if ctx.op == "adasum" else "gradsync"
    lines = []
    for key, mode in (("oop", "out-of-place"), ("ip", "in-place")):
        res = [r[key] for r in rows if r.get(key)]
        rs = [x["ratio_" + k1] for x in res if x.get("ratio_" + k1)]
        fs = [x["ratio_" + k2] for x in res if x.get("ratio_" + k2)]
        if not rs:
            continue
        line = ("# %s: %s/%s time ratio median %.3f (min %.3f max %.3f); %s/%s median %.3f"
                % (mode, me, t1, statistics.median(rs), min(rs), max(rs), me, t2,
                   statistics.median(fs)))
        if ctx.op == "adasum":
            bw = sum(x.get("baseline_wrong") or 0 for x in res)
            line += ("; speedup over %s %.2fx; %s #wrong %s"
                     % (t1, 1.0 / statistics.median(rs), t1,
                        bw if ctx.check else "N/A"))
        lines.append(line)
    return lines


def metadata(ctx, args):
    MPI = ctx.MPI
    try:
        info = ctx.gs.build_info()
        info = json.loads(json.dumps(info, default=str))
    except Exception as exc:  # keep the benchmark going; record why
        info = {"error": repr(exc)}
    lvl = MPI.Query_thread()
    names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
             MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}
    import numpy as np
    import mpi4py
    return {
        "tool": "gsbench",
        "argv": sys.argv,
        "ranks": ctx.nranks,
        "collective": ctx.collective,
        "dtype": ctx.dtype_name,
        "op": ctx.op,
        "iters": ctx.iters,
        "warmup": ctx.warmup,
        "repeats": ctx.repeats,
        "statistic": "median over repeats of max over ranks of mean time per iteration",
        "check": bool(ctx.check),
        "tensors": args.tensors,
        "alloc": ctx.alloc,
        "shapes": args.shapes,
        "baseline": ctx.baseline,
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        if MPI.Get_library_version().strip() else None,
        "mpi_library_full": MPI.Get_library_version().strip(),
        "mpi_version": "%d.%d" % MPI.Get_version(),
        "mpi4py_version": mpi4py.__version__,
        "numpy_version": np.__version__,
        "python": platform.python_version(),
        "thread_level": names.get(lvl, str(lvl)),
        "processor_name": MPI.Get_processor_name(),
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith("GRADSYNC_")},
        "gradsync_build_info": info,
        "fusion_threshold": getattr(ctx.gscomm, "fusion_threshold", None),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_meta(ctx, meta):
    p = ctx.out
    p("# gsbench: gradsync %s, %d ranks, %s %s, iters %d warmup %d repeats %d "
      "(median over repeats of max-over-ranks mean), check %d"
      % (ctx.collective, ctx.nranks, ctx.dtype_name,
         ctx.op if ctx.collective in REDUCING else "",
         ctx.iters, ctx.warmup, ctx.repeats, ctx.check))
    p("# MPI: %s (MPI %s), thread level %s, mpi4py %s"
      % (meta["mpi_library"], meta["mpi_version"], meta["thread_level"],
         meta["mpi4py_version"]))
    bi = meta["gradsync_build_info"]
    p("# gradsync build_info: %s" % json.dumps(bi, sort_keys=True))
    env = meta["env"]
    p("# GRADSYNC env: %s; fusion_threshold %s; load average %s"
      % (", ".join("%s=%s" % kv for kv in env.items()) or "(defaults)",
         meta["fusion_threshold"],
         " ".join("%.2f" % x for x in meta["loadavg"]) if meta["loadavg"] else "?"))
    if ctx.op == "adasum":
        p("# adasum: busbw uses the allreduce factor 2(n-1)/n; checked inputs: even tensors "
          "equal on every rank, odd tensors on disjoint elements (exact result known)")
        if ctx.baseline == "mpi4py":
            p("# np+mpi: one mpi4py Allgather of the packed list + the Adasum tree per tensor "
              "in NumPy float64; gs sum: gradsync op=sum of the same list; "
              "ratio = adasum time / that time")


def plot(rows, path, ctx, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out("# --plot: matplotlib is not installed; no plot written")
        return
    fig, ax = plt.subplots()
    for key, name in (("oop", "out-of-place"), ("ip", "in-place")):
        pts = [(r["size"], r[key]["busbw"]) for r in rows if r.get(key)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label="gradsync " + name)
        if ctx.baseline == "mpi4py":
            f = busbw_factor(ctx.collective, ctx.nranks)
            pts = [(r["size"], r["size"] / (r[key]["mpi4py_us"] * 1e-6) / 1e9 * f)
                   for r in rows if r.get(key) and r[key].get("mpi4py_us")]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x",
                        linestyle="--", label="mpi4py " + name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (B)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title("gradsync %s %s %s, %d ranks" % (ctx.collective, ctx.dtype_name,
                                                    ctx.op, ctx.nranks))
    ax.legend()
    fig.savefig(path)
    out("# plot written to %s" % path)
