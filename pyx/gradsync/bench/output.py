"""gsbench output: table header and rows, run metadata, summary, plot."""

import json
import os
import platform
import sys
import time

from gradsync.bench.args import HAS_INPLACE, INPLACE_ONLY, REDUCING, SHARDED, human
from gradsync.bench.baselines import baseline_columns, baseline_descriptions


def fmt_num(v, width, spec):
    if v is None:
        return "n/a".rjust(width)
    return format(v, spec).rjust(width)


def shown_modes(ctx):
    """The modes that have a column block in this run's tables."""
    return [m for m in ctx.modes
            if (m == "out-of-place" and ctx.collective not in INPLACE_ONLY)
            or (m == "in-place" and ctx.collective in HAS_INPLACE)]


def header_lines(ctx, show_tensors, baseline_cols=True):
    """The three header lines of a table; ``baseline_cols``: with the
    baseline time and ratio columns (the gradsync table of --baseline)."""
    base = ctx.baseline == "mpi4py" and baseline_cols
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
    modes = shown_modes(ctx)
    title = ""
    for m in modes:
        title += " " + m.center(len(blk1) - 1)
    return ["#" + " " * (len(left1) - 1) + title,
            "#" + left1[1:] + "".join(blk1 for _ in modes),
            "#" + left2[1:] + "".join(blk2 for _ in modes)]


def _left(row, show_tensors):
    s = "%12d %12d %9s %7s" % (row["size"], row["count"], row["type"], row["op"])
    if show_tensors:
        s += " %7d" % row["tensors"]
    return s


def _block(time_us, algbw, busbw, wrong):
    return (" " + fmt_num(time_us, 10, ".2f") + " " + fmt_num(algbw, 8, ".3f")
            + " " + fmt_num(busbw, 8, ".3f")
            + " " + ("%6d" % wrong if wrong is not None else "   N/A"))


def format_row(ctx, row, show_tensors):
    """A row of the gradsync table (with the baseline columns under --baseline)."""
    s = _left(row, show_tensors)
    for key in ("oop", "ip"):
        if key not in row or row[key] is None:
            continue
        r = row[key]
        s += _block(r["time_us"], r["algbw"], r["busbw"], r["wrong"])
        if ctx.baseline == "mpi4py":
            for name, _, _ in baseline_columns(ctx):
                s += " " + fmt_num(r.get(name + "_us"), 10, ".2f")
                s += " " + fmt_num(r.get("ratio_" + name), 6, ".3f")
    return s


def format_baseline_row(row, name, show_tensors):
    """A row of baseline ``name``'s own table."""
    s = _left(row, show_tensors)
    for key in ("oop", "ip"):
        if key not in row or row[key] is None:
            continue
        r = row[key]
        s += _block(r.get(name + "_us"), r.get(name + "_algbw"), r.get(name + "_busbw"),
                    r.get(name + "_wrong"))
    return s


def baseline_names(ctx, rows):
    """Keys of the baselines measured in this run (each has its own table)."""
    if ctx.baseline != "mpi4py":
        return []
    return [name for name, _, _ in baseline_columns(ctx)
            if any((r.get(k) or {}).get(name + "_us") is not None
                   for r in rows for k in ("oop", "ip"))]


def baseline_tables(ctx, rows, show_tensors):
    """The printed lines of every baseline's own table (nccl-tests columns)."""
    titles = {name: title for name, title, _ in baseline_columns(ctx)}
    descr = dict(zip([n for n, _, _ in baseline_columns(ctx)], baseline_descriptions(ctx)))
    lines = []
    for name in baseline_names(ctx, rows):
        lines.append("#")
        lines.append("# baseline table, %s" % descr.get(name, titles[name]))
        if any((r.get(k) or {}).get(name + "_same_as") for r in rows for k in ("oop", "ip")):
            lines.append("# (rows of one tensor repeat the %s numbers: the same call)"
                         % titles[baseline_columns(ctx)[0][0]])
        lines.extend(header_lines(ctx, show_tensors, baseline_cols=False))
        lines.extend(format_baseline_row(r, name, show_tensors) for r in rows)
    return lines


def tables(ctx, rows):
    """Every table as flat rows, one per size per mode: {"gradsync": [...],
    BASELINE: [...]}, each row with the nccl-tests columns, the samples and
    (gradsync) the ratio to each baseline."""
    cols = [name for name, _, _ in baseline_columns(ctx)] if ctx.baseline == "mpi4py" else []
    names = baseline_names(ctx, rows)
    out = {"gradsync": []}
    out.update({name: [] for name in names})
    for row in rows:
        left = {k: row[k] for k in ("size", "count", "type", "op", "tensors", "collective")}
        for k in ("shapes", "moved_bytes", "padded", "rank_count"):
            if k in row:
                left[k] = row[k]
        if ctx.collective == "broadcast":
            left["root"] = row["root"]
        for key, mode in (("oop", "out-of-place"), ("ip", "in-place")):
            r = row.get(key)
            if not r:
                continue
            g = dict(left, mode=mode, time_us=r["time_us"], algbw=r["algbw"],
                     busbw=r["busbw"], wrong=r["wrong"], samples_us=r["samples_us"])
            for name in cols:
                g["ratio_" + name] = r.get("ratio_" + name)
            out["gradsync"].append(g)
            for name in names:
                b = dict(left, mode=mode, time_us=r.get(name + "_us"),
                         algbw=r.get(name + "_algbw"), busbw=r.get(name + "_busbw"),
                         wrong=r.get(name + "_wrong"),
                         samples_us=r.get(name + "_samples_us"))
                if r.get(name + "_same_as"):
                    b["same_as"] = r[name + "_same_as"]
                out[name].append(b)
    return out


def ratio_summary(ctx, rows):
    """Summary lines of the baseline ratios (median, min, max over rows), per mode."""
    import statistics
    if ctx.baseline != "mpi4py":
        return []
    cols = baseline_columns(ctx)
    me = "adasum" if ctx.op == "adasum" else "gradsync"
    lines = []
    for key, mode in (("oop", "out-of-place"), ("ip", "in-place")):
        res = [r[key] for r in rows if r.get(key)]
        parts = []
        for i, (k, t, _) in enumerate(cols):
            rs = [x["ratio_" + k] for x in res if x.get("ratio_" + k)]
            if not rs:
                continue
            if i == 0:
                parts.append("%s/%s time ratio median %.3f (min %.3f max %.3f)"
                             % (me, t, statistics.median(rs), min(rs), max(rs)))
            else:
                parts.append("%s/%s median %.3f" % (me, t, statistics.median(rs)))
        if not parts:
            continue
        line = "# %s: %s" % (mode, "; ".join(parts))
        if ctx.op == "adasum":
            rs = [x["ratio_numpy"] for x in res if x.get("ratio_numpy")]
            bw = sum(x.get("baseline_wrong") or 0 for x in res)
            line += ("; speedup over %s %.2fx; %s #wrong %s"
                     % (cols[0][1], 1.0 / statistics.median(rs), cols[0][1],
                        bw if ctx.check else "N/A"))
        lines.append(line)
    return lines


def ratio_medians(ctx, rows):
    """{mode: {baseline: median ratio}} for the JSON summary."""
    import statistics
    out = {}
    if ctx.baseline != "mpi4py":
        return out
    for key, mode in (("oop", "out-of-place"), ("ip", "in-place")):
        res = [r[key] for r in rows if r.get(key)]
        med = {}
        for k, _, _ in baseline_columns(ctx):
            rs = [x["ratio_" + k] for x in res if x.get("ratio_" + k)]
            if rs:
                med[k] = statistics.median(rs)
        if med:
            out[mode] = med
    return out


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
    import mpi4py
    import numpy as np
    return {
        "tool": "gsbench",
        "argv": getattr(ctx, "argv", sys.argv),
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
    if ctx.collective in SHARDED:
        p("# %s: in place over gs.ShardLayout (align = 32 x ranks elements, always padded "
          "by one more block); size = the whole unpadded list; busbw = algbw x (n-1)/n; "
          "tensors that would cross a rank's range are cut there" % ctx.collective)
    if ctx.collective == "accumulate":
        p("# accumulate: gs.accumulate_(acc float32, grad %s) of the list, on every rank at "
          "once; size = the grads' bytes; algbw = busbw = bytes moved (acc read + written, "
          "grad read: %d B per element) / time"
          % (ctx.dtype_name, 8 + ctx.itemsize))
    if ctx.baseline == "mpi4py":
        for line in baseline_descriptions(ctx):
            p("# baseline " + line)
        p("# ratio = %s time / baseline time (below 1: gradsync is faster)"
          % ("adasum" if ctx.op == "adasum" else "gradsync"))


def plot_available():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PLOT_MISSING = ("gsbench: --plot needs matplotlib, which is not installed "
                "(pip install matplotlib); no plot written")


def plot(tabs, path, ctx, out):
    """busbw and time against size, every table (gradsync and baselines) and
    mode on one figure of two panels. Returns True when written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write(PLOT_MISSING + "\n")
        out("# " + PLOT_MISSING)
        return False
    titles = {"gradsync": "adasum" if ctx.op == "adasum" else "gradsync"}
    titles.update({name: title for name, title, _ in baseline_columns(ctx)})
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for ti, (name, trows) in enumerate(tabs.items()):
        for mode, marker in (("out-of-place", "o"), ("in-place", "s")):
            # rows that only repeat another baseline (fused1 of one tensor) are left out
            pts = sorted((r["size"], r["busbw"], r["time_us"]) for r in trows
                         if r["mode"] == mode and r["time_us"] is not None
                         and not r.get("same_as"))
            if not pts:
                continue
            style = "-" if name == "gradsync" else "--"
            label = "%s %s" % (titles.get(name, name), mode)
            color = "C%d" % (2 * ti + (mode == "in-place"))
            ax_bw.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                       color=color, label=label, markersize=4)
            ax_t.plot([p[0] for p in pts], [p[2] for p in pts], style, marker=marker,
                      color=color, label=label, markersize=4)
    from matplotlib.ticker import FuncFormatter
    for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_t, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(int(round(v)))))
        ax.set_xlabel("size (B)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    ax_t.set_yscale("log")
    ax_bw.legend(fontsize=7)
    op = ctx.op if ctx.collective in REDUCING else ""
    fig.suptitle("gsbench %s %s %s, %d ranks" % (ctx.collective, ctx.dtype_name, op,
                                                   ctx.nranks))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    out("# plot written to %s" % path)
    return True


def write_json(path, data):
    """Writes ``data`` to ``path`` whole or not at all (a temporary file, then
    a rename), so a run cut short leaves the last complete results. NumPy
    scalars become numbers, anything else JSON does not know its str()."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=_plain)
    os.replace(tmp, path)


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
