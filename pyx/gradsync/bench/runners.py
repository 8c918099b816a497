"""gsbench runners: the gradsync call of each collective, its check, a row, latency."""

from gradsync.bench.args import HAS_INPLACE, REDUCING, SHARDED, busbw_factor, moved_bytes
from gradsync.bench.baselines import (
    accumulate_baseline_call,
    adasum_baseline_call,
    baseline_call,
    baseline_columns,
    baseline_supported,
    gs_sum_call,
    mpi_op,
    shard_baseline_call,
)
from gradsync.bench.data import Buffers, count_wrong
from gradsync.bench.timing import measure


def gradsync_call(ctx, bufs, mode, outputs_ref):
    """A zero-argument callable running one gradsync iteration of this mode."""
    comm, coll, op = ctx.gscomm, ctx.collective, ctx.op
    ins = bufs.inputs
    if coll == "allreduce":
        if mode == "in-place":
            return lambda: comm.allreduce_(ins, op)

        def f():
            outputs_ref[0] = comm.allreduce(ins, op)
        return f
    if coll == "broadcast":
        root = ctx.root
        if mode == "in-place":
            return lambda: comm.broadcast_(ins, root=root)

        def f():
            outputs_ref[0] = comm.broadcast(ins, root=root)
        return f
    if coll == "allgather":
        def f():
            outputs_ref[0] = comm.allgather(ins)
        return f
    if coll == "reduce_scatter":
        def f():
            outputs_ref[0] = comm.reduce_scatter(ins, op)
        return f
    if coll == "allgather_shards":
        return lambda: comm.allgather_shards_(ins)
    if coll == "reduce_scatter_shards":
        return lambda: comm.reduce_scatter_shards_(ins, op)
    if coll == "accumulate":
        accumulate_, accs = ctx.gs.accumulate_, bufs.accs
        return lambda: accumulate_(accs, ins)
    raise ValueError(coll)


def check_gradsync(ctx, bufs, mode):
    """One checked iteration; the number of wrong elements summed over ranks."""
    bufs.reset()
    wrong = 0
    try:
        ref = [None]
        gradsync_call(ctx, bufs, mode, ref)()
        if mode == "in-place":
            results = bufs.results()
            if results is not bufs.inputs:  # accumulate must not touch grad
                for i, a in enumerate(bufs.inputs):
                    wrong += count_wrong(a, bufs._cast(bufs.input_values(i)))
        else:
            results = ref[0]
            if not isinstance(results, (list, tuple)):
                results = [results]
            # out-of-place must leave the input alone
            for i, a in enumerate(bufs.inputs):
                wrong += count_wrong(a, bufs._cast(bufs.input_values(i)))
        if len(results) != len(bufs.inputs):
            wrong += sum(bufs.out_counts)
        else:
            for i, res in enumerate(results):
                wrong += count_wrong(res, bufs.expected_output(i))
    finally:
        bufs.reset()
    return ctx.mpicomm.allreduce(wrong, op=ctx.MPI.SUM)


def baseline_fns(ctx, bufs, case, mode):
    """name -> callable of every baseline of this row and mode (each with ``check()``)."""
    fns = {}
    if ctx.op == "adasum":
        fns["numpy"] = adasum_baseline_call(ctx, bufs, mode)
        fns["gssum"] = gs_sum_call(ctx, bufs, mode)
    elif ctx.collective in SHARDED:
        fns["mpi4py"] = shard_baseline_call(ctx, bufs, packed=False)
        fns["packed"] = shard_baseline_call(ctx, bufs, packed=True)
    elif ctx.collective == "accumulate":
        fns["numpy"] = accumulate_baseline_call(ctx, bufs)
    else:
        fns["mpi4py"] = baseline_call(ctx, bufs, mode, fused=False)
        if case.ntensors > 1:
            fns["fused1"] = baseline_call(ctx, bufs, mode, fused=True)
    return fns


def run_row(ctx, case, size_label):
    row = {
        "size": case.total * ctx.itemsize,
        "count": case.total,
        "type": ctx.dtype_name,
        "op": ctx.op if ctx.collective in REDUCING else "none",
        "root": ctx.root if ctx.collective == "broadcast" else -1,
        "tensors": case.ntensors,
        "collective": ctx.collective,
    }
    if case.label:
        row["shapes"] = case.label
    factor = busbw_factor(ctx.collective, ctx.nranks)
    moved = moved_bytes(ctx.collective, row["size"], case.total, ctx.itemsize)
    if moved != row["size"]:
        row["moved_bytes"] = moved
    bufs = Buffers(ctx, case)
    if bufs.layout is not None:
        row["padded"] = int(bufs.layout.padded)
        row["rank_count"] = int(bufs.layout.rank_count)
    do_base = baseline_supported(ctx)
    for mode in ctx.modes:
        key = "oop" if mode == "out-of-place" else "ip"
        res = {}
        if mode == "in-place" and ctx.collective not in HAS_INPLACE:
            row[key] = None
            continue
        if ctx.check:
            ctx.progress.show("%s %s check" % (size_label, mode))
            res["wrong"] = check_gradsync(ctx, bufs, mode)
        else:
            res["wrong"] = None
        ref = [None]
        fns = {"gradsync": gradsync_call(ctx, bufs, mode, ref)}
        base = baseline_fns(ctx, bufs, case, mode) if do_base else {}
        base_wrong = {}
        for name, fn in base.items():
            if ctx.check:
                ctx.progress.show("%s %s check %s" % (size_label, mode, name))
                base_wrong[name] = ctx.mpicomm.allreduce(fn.check(), op=ctx.MPI.SUM)
            fns[name] = fn
        got = measure(ctx, fns, "%s %s" % (size_label, mode))
        ref[0] = None
        t, samples = got["gradsync"]
        res["time_us"] = t * 1e6
        res["samples_us"] = [s * 1e6 for s in samples]
        res["algbw"] = moved / t / 1e9 if t > 0 else 0.0
        res["busbw"] = res["algbw"] * factor
        cols = baseline_columns(ctx)
        for name, _, _ in cols if ctx.baseline == "mpi4py" else ():
            if not do_base:
                res[name + "_us"] = res["ratio_" + name] = None
                continue
            # one tensor: fused1 (not timed) IS the per-tensor loop, one call on one buffer
            src = name if name in got else cols[0][0]
            tb, sb = got[src]
            res[name + "_us"] = tb * 1e6
            res[name + "_samples_us"] = [s * 1e6 for s in sb]
            res["ratio_" + name] = t / tb if tb > 0 else None
            res[name + "_algbw"] = moved / tb / 1e9 if tb > 0 else 0.0
            res[name + "_busbw"] = res[name + "_algbw"] * factor
            res[name + "_wrong"] = base_wrong.get(src) if ctx.check else None
            if src != name:
                res[name + "_same_as"] = src
        if ctx.op == "adasum" and do_base:
            res["baseline_wrong"] = res.get("numpy_wrong")
        row[key] = res
    return row


def run_latency(ctx, args):
    """One 16-element float32 tensor: gradsync allreduce_ vs mpi4py Allreduce IN_PLACE."""
    import numpy as np
    MPI = ctx.MPI
    count = args.latency_count
    a = np.ones(count, dtype=np.float32)
    b = np.ones(count, dtype=np.float32)
    op = ctx.op
    comm, mc = ctx.gscomm, ctx.basecomm
    mop = mpi_op(ctx)
    # correctness of one call first
    wrong = 0
    if ctx.check:
        a[...] = ctx.rank + 1
        comm.allreduce_(a, "sum")
        wrong = ctx.mpicomm.allreduce(
            int(np.count_nonzero(a != np.float32(ctx.nranks * (ctx.nranks + 1) // 2))),
            op=MPI.SUM)
        a[...] = 1
    spec = [b, MPI.FLOAT]
    got = measure(ctx, {"gradsync": lambda: comm.allreduce_(a, op),
                        "mpi4py": lambda: mc.Allreduce(MPI.IN_PLACE, spec, mop)}, "latency")
    tg, sg = got["gradsync"]
    tm, sm = got["mpi4py"]
    ctx.progress.clear()
    row = {"latency": True, "count": count, "size": count * 4, "type": "float32",
           "op": op, "gradsync_us": tg * 1e6, "mpi4py_us": tm * 1e6,
           "ratio_mpi4py": tg / tm if tm > 0 else None,
           "gradsync_samples_us": [s * 1e6 for s in sg],
           "mpi4py_samples_us": [s * 1e6 for s in sm],
           "wrong": wrong if ctx.check else None}
    ctx.out("latency: %d x float32 %s, %d ranks: gradsync allreduce_ %.2f us, "
            "mpi4py Allreduce(IN_PLACE) %.2f us, ratio gs/mpi4py %.2f, "
            "+%.2f us (median of %d x %d iters; #wrong %s)"
            % (count, op, ctx.nranks, tg * 1e6, tm * 1e6, tg / tm if tm > 0 else float("nan"),
               (tg - tm) * 1e6, ctx.repeats, ctx.iters,
               wrong if ctx.check else "N/A"))
    return [row]
