"""gsbench entry point: parse flags, set up the run, print the tables.

``main(argv)`` is the command (an exit code; an error aborts the MPI job);
``run(argv)`` is the same run for use inside a Python program or a test: it
returns the results (on every rank) and raises instead of aborting.
"""

import sys
import traceback

from gradsync.bench.args import (
    FLOAT_DTYPES,
    HAS_INPLACE,
    INPLACE_ONLY,
    REDUCING,
    SHARDED,
    build_parser,
    human,
    size_list,
)
from gradsync.bench.baselines import baseline_supported
from gradsync.bench.data import load_shapes, make_case, numpy_dtype, shapes_case
from gradsync.bench.output import (
    PLOT_MISSING,
    baseline_tables,
    format_row,
    header_lines,
    metadata,
    plot,
    plot_available,
    print_meta,
    ratio_medians,
    ratio_summary,
    tables,
    write_json,
)
from gradsync.bench.runners import run_latency, run_row
from gradsync.bench.timing import Ctx, Progress


class UsageError(Exception):
    """A flag combination gsbench refuses (exit code 2)."""


def main(argv=None):
    """Entry point of ``gsbench`` / ``python -m gradsync.bench``; returns an exit
    code: 0, 1 when a checked iteration found wrong elements, 2 for a usage
    error. Any other error prints its traceback and aborts the MPI job."""
    args = build_parser().parse_args(argv)
    # gradsync first: it may choose the MPI thread level before mpi4py initializes MPI
    from mpi4py import MPI

    import gradsync as gs

    world = MPI.COMM_WORLD
    try:
        result = _run(args, gs, MPI, sys.argv if argv is None else list(argv))
    except SystemExit:
        raise
    except UsageError as exc:
        if world.Get_rank() == 0:
            sys.stderr.write("gsbench: %s\n" % exc)
        return 2
    except BaseException:
        sys.stderr.write("\n[gsbench rank %d] error:\n" % world.Get_rank())
        traceback.print_exc()
        sys.stderr.flush()
        if world.Get_size() > 1:
            world.Abort(1)
        return 1
    return 1 if result["summary"]["failed"] else 0


def run(argv):
    """Runs gsbench with the flags in ``argv`` (a list, without the program
    name) on every rank of COMM_WORLD and returns what ``--json`` writes:
    ``{"metadata": ..., "rows": [...], "tables": {...}, "summary": {...}}``,
    the same on every rank. Rank 0 prints the tables as the command does.
    Raises UsageError for a refused flag combination and any error as is."""
    args = build_parser().parse_args(list(argv))
    from mpi4py import MPI

    import gradsync as gs
    return _run(args, gs, MPI, ["gsbench"] + list(argv))


def _check_args(ctx, args):
    if ctx.iters < 1 or ctx.warmup < 0 or ctx.repeats < 1 or args.tensors < 1:
        raise UsageError("-n, --repeats and --tensors must be >= 1, -w >= 0")
    if not 0 <= ctx.root < ctx.nranks:
        raise UsageError("root %d out of range for %d ranks" % (ctx.root, ctx.nranks))
    if ctx.collective in REDUCING and ctx.op == "average" and \
            ctx.dtype_name not in FLOAT_DTYPES:
        raise UsageError("op average needs a floating dtype (got %s)" % ctx.dtype_name)
    if ctx.op == "adasum" and (args.latency or ctx.collective != "allreduce"
                               or ctx.dtype_name not in FLOAT_DTYPES):
        raise UsageError("op adasum: allreduce of float16/bfloat16/float32/float64 only "
                         "(not --latency)")
    if ctx.collective == "accumulate" and ctx.dtype_name not in FLOAT_DTYPES and \
            not args.latency:
        raise UsageError("accumulate: -d must be float16, bfloat16, float32 or float64 "
                         "(the gradients' dtype; the accumulators are float32)")
    if args.inplace_only and ctx.collective not in HAS_INPLACE and not args.latency:
        raise UsageError("%s has no in-place variant" % ctx.collective)
    if args.outplace_only and ctx.collective in INPLACE_ONLY and not args.latency:
        raise UsageError("%s has only an in-place variant" % ctx.collective)


def _run(args, gs, MPI, argv):
    ctx = Ctx()
    ctx.gs, ctx.MPI = gs, MPI
    ctx.argv = argv
    ctx.rank = MPI.COMM_WORLD.Get_rank()
    ctx.nranks = MPI.COMM_WORLD.Get_size()
    ctx.latency = args.latency
    ctx.collective = args.collective
    ctx.dtype_name = "float32" if args.latency else args.datatype
    ctx.np_dtype = numpy_dtype(ctx.dtype_name)
    ctx.itemsize = ctx.np_dtype.itemsize
    ctx.op = args.op
    ctx.root = args.root
    ctx.check = args.check
    ctx.alloc = args.alloc
    ctx.baseline = "mpi4py" if args.latency else args.baseline
    ctx.iters = args.iters if args.iters is not None else (1000 if args.latency else 20)
    ctx.warmup = (args.warmup_iters if args.warmup_iters is not None
                  else (100 if args.latency else 5))
    ctx.repeats = args.repeats
    _check_args(ctx, args)  # the same verdict on every rank: nothing collective yet
    is_root = ctx.rank == 0
    ctx.progress = Progress(is_root and not args.no_progress)
    ctx.out = (lambda s: (ctx.progress.clear(), print(s, flush=True))) if is_root \
        else (lambda s: None)
    ctx.modes = ["out-of-place", "in-place"]
    if args.inplace_only or ctx.collective in INPLACE_ONLY:
        ctx.modes = ["in-place"]
    elif args.outplace_only:
        ctx.modes = ["out-of-place"]
    if args.plot and is_root and not plot_available():
        sys.stderr.write(PLOT_MISSING + "\n")  # say so now, not after the run

    ctx.mpicomm = MPI.COMM_WORLD.Dup()     # barriers and timing reductions
    ctx.basecomm = MPI.COMM_WORLD.Dup()    # the mpi4py baseline
    kw = {}
    if args.fusion_threshold is not None:
        kw["fusion_threshold"] = args.fusion_threshold
    ctx.gscomm = gs.Communicator(**kw)
    try:
        return _bench(ctx, args)
    finally:
        ctx.progress.clear()
        ctx.gscomm.close()
        ctx.mpicomm.Free()
        ctx.basecomm.Free()


def _bench(ctx, args):
    is_root = ctx.rank == 0
    meta = metadata(ctx, args)
    print_meta(ctx, meta)
    rows = []
    if args.latency:
        rows = run_latency(ctx, args)
    else:
        if args.shapes:
            shapes, path = load_shapes(args.shapes, args.shapes_file)
            meta["shapes_file"] = path
            cases = [shapes_case(ctx.collective, shapes, ctx.nranks, args.shapes)]
            ctx.out("# shapes: %s, %d tensors%s, %d elements (%s)"
                    % (args.shapes, cases[0].ntensors,
                       " after cutting at shard boundaries (%d in the model)" % len(shapes)
                       if ctx.collective in SHARDED else "",
                       cases[0].total, path))
        else:
            maxb = args.maxbytes if args.maxbytes is not None else args.minbytes
            cases = []
            for nbytes in size_list(args.minbytes, maxb, args.stepfactor):
                c = make_case(ctx.collective, nbytes, ctx.itemsize, args.tensors, ctx.nranks)
                if c is not None:
                    cases.append(c)
        if ctx.baseline == "mpi4py" and not baseline_supported(ctx):
            ctx.out("# baseline: mpi4py cannot reduce %s; baseline columns are n/a"
                    % ctx.dtype_name)
        show_tensors = args.tensors > 1 or bool(args.shapes) or ctx.collective in SHARDED
        for line in header_lines(ctx, show_tensors):
            ctx.out(line)
        for case in cases:
            row = run_row(ctx, case, human(case.total * ctx.itemsize))
            rows.append(row)
            ctx.out(format_row(ctx, row, show_tensors))
        ctx.progress.clear()
        # nccl-tests' summary line
        bws = [r[k]["busbw"] for r in rows for k in ("oop", "ip") if r.get(k)]
        wrong = sum((r[k]["wrong"] or 0) for r in rows for k in ("oop", "ip") if r.get(k))
        ctx.out("# Out of bounds values : %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"))
        ctx.out("# Avg bus bandwidth    : %.4f GB/s" % (sum(bws) / len(bws) if bws else 0.0))
        for line in ratio_summary(ctx, rows):
            ctx.out(line)
        for line in baseline_tables(ctx, rows, show_tensors):
            ctx.out(line)
    tabs = tables(ctx, rows) if not args.latency else {}
    gs_wrong = sum(r["wrong"] or 0 for r in tabs.get("gradsync", ()))
    base_wrong = {name: sum(r["wrong"] or 0 for r in trows)
                  for name, trows in tabs.items() if name != "gradsync"}
    if args.latency:
        gs_wrong = sum(r.get("wrong") or 0 for r in rows)
    if base_wrong:
        ctx.out("# baseline #wrong: %s" % ", ".join("%s %d" % kv for kv in base_wrong.items()))
    summary = {
        "wrong": gs_wrong,
        "baseline_wrong": base_wrong,
        "failed": bool(gs_wrong or any(base_wrong.values())),
        "avg_busbw": (sum(r["busbw"] for r in tabs["gradsync"]) / len(tabs["gradsync"])
                      if tabs.get("gradsync") else None),
        "ratio_medians": ratio_medians(ctx, rows),
    }
    result = {"metadata": meta, "rows": rows, "tables": tabs, "summary": summary}
    if args.plot and is_root and not args.latency:
        plot(tabs, args.plot, ctx, ctx.out)
    ctx.progress.clear()
    if args.json and is_root:
        write_json(args.json, result)
        ctx.out("# JSON written to %s" % args.json)
    return result
