"""gsbench entry point: parse flags, set up the run, print the table."""

import json
import sys
import traceback

from gradsync.bench.args import FLOAT_DTYPES, HAS_INPLACE, REDUCING, build_parser, human, size_list
from gradsync.bench.baselines import baseline_supported
from gradsync.bench.data import load_shapes, make_case, numpy_dtype, shapes_case
from gradsync.bench.output import (format_row, header_lines, metadata, plot, print_meta,
                                   ratio_summary)
from gradsync.bench.runners import run_latency, run_row
from gradsync.bench.timing import Ctx, Progress

def main(argv=None):
    """Entry point of ``gsbench`` / ``python -m gradsync.bench``; returns an exit code."""
    args = build_parser().parse_args(argv)
    # gradsync first: it may choose the MPI thread level before mpi4py initializes MPI
    import gradsync as gs
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        return _main(args, gs, MPI)
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write("\n[gsbench rank %d] error:\n" % world.Get_rank())
        traceback.print_exc()
        sys.stderr.flush()
        if world.Get_size() > 1:
            world.Abort(1)
        return 1


def _main(args, gs, MPI):
    ctx = Ctx()
    ctx.gs, ctx.MPI = gs, MPI
    ctx.mpicomm = MPI.COMM_WORLD.Dup()     # barriers and timing reductions
    ctx.basecomm = MPI.COMM_WORLD.Dup()    # the mpi4py baseline
    ctx.rank = ctx.mpicomm.Get_rank()
    ctx.nranks = ctx.mpicomm.Get_size()
    kw = {}
    if args.fusion_threshold is not None:
        kw["fusion_threshold"] = args.fusion_threshold
    ctx.gscomm = gs.Communicator(**kw)
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
    is_root = ctx.rank == 0
    ctx.out = (lambda s: (ctx.progress.clear(), print(s, flush=True))) if is_root \
        else (lambda s: None)
    ctx.progress = Progress(is_root and not args.no_progress)

    def fail(msg):
        if is_root:
            sys.stderr.write("gsbench: %s\n" % msg)
        return 2

    if ctx.iters < 1 or ctx.warmup < 0 or ctx.repeats < 1 or args.tensors < 1:
        return fail("-n, --repeats and --tensors must be >= 1, -w >= 0")
    if not 0 <= ctx.root < ctx.nranks:
        return fail("root %d out of range for %d ranks" % (ctx.root, ctx.nranks))
    if ctx.collective in REDUCING and ctx.op == "average" and \
            ctx.dtype_name not in FLOAT_DTYPES:
        return fail("op average needs a floating dtype (got %s)" % ctx.dtype_name)
    if ctx.op == "adasum" and (args.latency or ctx.collective != "allreduce"
                               or ctx.dtype_name not in FLOAT_DTYPES):
        return fail("op adasum: allreduce of float16/bfloat16/float32/float64 only "
                    "(not --latency)")
    if args.inplace_only and ctx.collective not in HAS_INPLACE and not args.latency:
        return fail("%s has no in-place variant" % ctx.collective)
    ctx.modes = ["out-of-place", "in-place"]
    if args.inplace_only:
        ctx.modes = ["in-place"]
    elif args.outplace_only:
        ctx.modes = ["out-of-place"]

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
            ctx.out("# shapes: %s, %d tensors, %d elements (%s)"
                    % (args.shapes, cases[0].ntensors, cases[0].total, path))
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
        show_tensors = args.tensors > 1 or bool(args.shapes)
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
        if args.plot and is_root:
            plot(rows, args.plot, ctx, ctx.out)
    ctx.progress.clear()
    if args.json and is_root:
        with open(args.json, "w") as fh:
            json.dump({"metadata": meta, "rows": rows}, fh, indent=1, default=str)
        ctx.out("# JSON written to %s" % args.json)
    bad = any(((r.get(k) or {}).get("wrong") or 0) for r in rows for k in ("oop", "ip")) or \
        any(r.get("wrong") for r in rows)
    ctx.gscomm.close() if hasattr(ctx.gscomm, "close") else None
    ctx.mpicomm.Free()
    ctx.basecomm.Free()
