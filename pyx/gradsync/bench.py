"""gsbench: an nccl-tests-style benchmark for gradsync collectives.

Run it as ``scripts/gsbench`` or ``python -m gradsync.bench`` under ``mpiexec``.
Only rank 0 prints; a progress line goes to rank 0's stderr.

The four performance targets (docs/PERFORMANCE.md), each one command at 2 ranks::

    # (a) 200 float32 tensors of 768 elements, fused allreduce_ vs a loop of
    #     mpi4py Allreduce over the same 200 tensors (target: >= 10x faster)
    mpiexec -n 2 python scripts/gsbench -b 614400 -e 614400 --tensors 200 \\
        --inplace-only -n 50 -w 10 --repeats 7 -c 1 --baseline mpi4py

    # (b) ResNet-50 gradient list (161 tensors, 25.6M float32) vs one mpi4py
    #     Allreduce of a pre-fused buffer ("fused1", within 15%) and vs the
    #     per-tensor loop ("mpi4py", faster)
    mpiexec -n 2 python scripts/gsbench --shapes resnet50 --inplace-only \\
        -n 10 -w 3 --repeats 7 -c 1 --baseline mpi4py

    # (c) one float32 tensor of 16M elements (64 MiB) vs mpi4py Allreduce on
    #     the same buffer (within 5%)
    mpiexec -n 2 python scripts/gsbench -b 64M -e 64M -n 10 -w 3 --repeats 7 \\
        -c 1 --baseline mpi4py

    # (d) small-message latency: one 16-element float32 tensor vs mpi4py
    #     (prefix GRADSYNC_CHECK=0 to see the cost without cross-rank validation)
    mpiexec -n 2 python scripts/gsbench --latency --repeats 7

Table columns (per mode, out-of-place then in-place)::

    size(B) count type op | time(us) algbw(GB/s) busbw(GB/s) #wrong
                            [mpi4py(us) ratio fused1(us) ratio]  with --baseline

* time: a barrier, then ``-n`` back-to-back iterations; the average per
  iteration is taken on every rank and the maximum over ranks is kept (as
  nccl-tests does). That measurement is repeated ``--repeats`` times (after
  ``-w`` warmup iterations) and the MEDIAN is reported. gradsync and the
  baselines are interleaved within each repeat (gradsync, mpi4py, fused1,
  gradsync, ...), so outside load on a shared machine hits them alike; every
  sample is kept in ``--json``.
* algbw = size / time; busbw = algbw * factor, factor 2(n-1)/n for allreduce,
  (n-1)/n for allgather and reduce_scatter, 1 for broadcast.
* size: allreduce/broadcast, the buffer; allgather, the gathered (output)
  buffer; reduce_scatter, the input buffer (nccl-tests' convention).
* #wrong (``-c 1``): one extra checked iteration per mode whose result is exact
  (small integers, so float sums are exact), the number of wrong elements summed
  over ranks (out-of-place also counts changes to the input).
* mpi4py: the same tensor list through plain mpi4py, one call per tensor
  (``Allreduce``, ``Bcast``, ``Allgather``, ``Reduce_scatter_block``);
  fused1: ONE mpi4py call on one pre-fused buffer of the total size (the
  speed-of-light of a fused design, no packing). ratio = gradsync_time /
  baseline_time (below 1: gradsync is faster). Out-of-place baselines reuse
  preallocated receive buffers; gradsync's out-of-place calls allocate their
  results (that is the API). op=average in the baselines is SUM followed by a
  numpy multiply by 1/n. float16/bfloat16 reductions have no mpi4py baseline
  ("n/a"); their broadcast/allgather go as MPI.SHORT.
* ``--tensors K`` splits each size into K separately allocated tensors of
  nearly equal size (not back to back in one allocation, so gradsync's fusion
  path is measured; ``--alloc contiguous`` carves them out of one allocation).

Cross-rank validation (GRADSYNC_CHECK, default 1) is part of every gradsync
call; run with ``GRADSYNC_CHECK=0`` in the environment to measure without it.
The setting is recorded in the header and in ``--json``.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

__all__ = ["main"]

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
OPS = ("sum", "average", "min", "max", "prod")
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter")
# Collectives that reduce (op matters) and those with an in-place variant.
REDUCING = ("allreduce", "reduce_scatter")
HAS_INPLACE = ("allreduce", "broadcast")
MODES = ("out-of-place", "in-place")
_HERE = os.path.dirname(os.path.realpath(__file__))
SHAPES_FILES = (
    # $GRADSYNC_SHAPES_FILE, then the checkout (<root>/pyx/gradsync/bench.py):
    # <root>/shared/data, <root>/../shared/data, <root>/data
    os.environ.get("GRADSYNC_SHAPES_FILE"),
    os.path.join(_HERE, "..", "..", "shared", "data", "gradient_shapes.json"),
    os.path.join(_HERE, "..", "..", "..", "shared", "data", "gradient_shapes.json"),
    os.path.join(_HERE, "..", "..", "data", "gradient_shapes.json"),
)


def busbw_factor(collective, nranks):
    """The nccl-tests bus-bandwidth factor of ``collective`` on ``nranks`` ranks."""
    if collective == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in ("allgather", "reduce_scatter"):
        return (nranks - 1) / nranks
    return 1.0


def parse_size(text):
    """'8', '1K', '64M', '1G', '1.5M' -> bytes (K/M/G are powers of 1024)."""
    t = text.strip().upper().rstrip("B")
    mult = 1
    if t and t[-1] in "KMGT":
        mult = 1024 ** ("KMGT".index(t[-1]) + 1)
        t = t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError("bad size %r (use e.g. 8, 1K, 64M, 1G)" % text)
    if value < 0:
        raise argparse.ArgumentTypeError("size must be >= 0: %r" % text)
    return value


def build_parser():
    p = argparse.ArgumentParser(
        prog="gsbench",
        description="nccl-tests-style benchmark of gradsync collectives "
                    "(run under mpiexec; only rank 0 prints).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n"
               "  mpiexec -n 2 gsbench -b 8 -e 128M -f 2 -c 1 --baseline mpi4py\n"
               "  mpiexec -n 2 gsbench --shapes resnet50 --baseline mpi4py\n"
               "  mpiexec -n 2 gsbench --latency\n")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"),
                   help="smallest size in bytes (K/M/G suffixes; default 32M)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=None,
                   help="largest size in bytes (default: minbytes)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0,
                   help="multiplication factor between sizes (default 2)")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed iterations per measurement (default 20; 1000 with --latency)")
    p.add_argument("-w", "--warmup_iters", type=int, default=None,
                   help="warmup iterations (default 5; 100 with --latency)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="1: run one checked iteration per mode and count wrong "
                        "elements (default 1)")
    p.add_argument("-d", "--datatype", default="float32", choices=DTYPES,
                   help="element type (default float32)")
    p.add_argument("-o", "--op", default="sum", choices=OPS,
                   help="reduction op (default sum)")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root rank of broadcast (default 0)")
    p.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                   help="collective to benchmark (default allreduce)")
    p.add_argument("--tensors", type=int, default=1, metavar="K",
                   help="split each size into K fused tensors of nearly equal size")
    p.add_argument("--alloc", default="separate", choices=("separate", "contiguous"),
                   help="K tensors as separate allocations (default) or carved "
                        "back to back out of one allocation")
    p.add_argument("--shapes", choices=("resnet50", "bert_base"), default=None,
                   help="one row: the model's gradient list (gradient_shapes.json)")
    p.add_argument("--shapes-file", default=None,
                   help="path of gradient_shapes.json (default: found next to the checkout)")
    p.add_argument("--baseline", choices=("none", "mpi4py"), default="none",
                   help="also time plain mpi4py (per-tensor loop and one fused buffer)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--inplace-only", action="store_true", help="time the in-place mode only")
    g.add_argument("--outplace-only", action="store_true",
                   help="time the out-of-place mode only")
    p.add_argument("--repeats", type=int, default=5, metavar="R",
                   help="repeat each measurement R times and report the median (default 5)")
    p.add_argument("--fusion-threshold", type=parse_size, default=None,
                   help="Communicator(fusion_threshold=...) in bytes "
                        "(default: GRADSYNC_FUSION_THRESHOLD or the library default)")
    p.add_argument("--latency", action="store_true",
                   help="one-line small-message latency summary: one 16-element float32 "
                        "tensor, gradsync allreduce_ vs mpi4py Allreduce (IN_PLACE)")
    p.add_argument("--latency-count", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write every row with all columns plus metadata to FILE")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="plot busbw against size to FILE (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


# --------------------------------------------------------------------------- data


class Case:
    """One row: a list of tensors (logical element counts and shapes)."""

    def __init__(self, counts, shapes=None, label=None):
        self.counts = [int(c) for c in counts]
        self.shapes = shapes  # list of tuples or None (1-D)
        self.label = label

    @property
    def total(self):
        return sum(self.counts)

    @property
    def ntensors(self):
        return len(self.counts)


def split_counts(total, k):
    """total elements into min(k, total) parts of nearly equal size (first ones larger)."""
    k = max(1, min(k, total)) if total > 0 else 1
    base, extra = divmod(total, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def make_case(collective, nbytes, itemsize, k, nranks):
    """The tensor list of one size row; None when the size is too small."""
    count = nbytes // itemsize
    if collective in ("allgather", "reduce_scatter"):
        per_rank = count // nranks
        if per_rank == 0:
            return None
        return Case([c * nranks for c in split_counts(per_rank, k)])
    if count == 0:
        return None
    return Case(split_counts(count, k))


def load_shapes(name, path=None):
    candidates = [path] if path else list(SHAPES_FILES)
    for cand in candidates:
        if cand and os.path.exists(cand):
            with open(cand) as fh:
                data = json.load(fh)
            if name not in data:
                raise SystemExit("gsbench: %s has no key %r" % (cand, name))
            shapes = [tuple(int(d) for d in s["shape"]) for s in data[name]["shapes"]]
            return shapes, os.path.abspath(cand)
    raise SystemExit("gsbench: gradient_shapes.json not found (tried %s); use --shapes-file"
                     % ", ".join(c for c in candidates if c))


def shapes_case(collective, shapes, nranks, label):
    numels = []
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        numels.append(n)
    if collective in ("allgather", "reduce_scatter"):
        # dim 0 must split evenly: flat tensors, numel rounded to a multiple of n
        return Case([max(1, n // nranks) * nranks for n in numels], None, label)
    return Case(numels, list(shapes), label)


def numpy_dtype(name):
    import numpy as np
    if name == "bfloat16":
        import gradsync as gs
        return np.dtype(gs.bfloat16)
    return np.dtype(name)


def value_range(dtype_name, op, nranks):
    """Pattern period m (values 1..m) so that every result is exact in dtype."""
    if op not in ("sum", "average"):
        return 13
    limit = {"int8": 127, "uint8": 255, "bfloat16": 256, "float16": 2048}.get(dtype_name, 1 << 24)
    return max(1, min(13, limit // max(1, nranks)))


def rank_pattern(rank, start, count, op, m, nranks):
    """int64 input values of ``rank`` for global element indices start..start+count."""
    import numpy as np
    idx = np.arange(start, start + count, dtype=np.int64)
    if op == "prod":
        # exactly one rank holds 2 per element, the others 1: product 2 (or 2**0)
        return np.where(idx % nranks == rank, 2, 1).astype(np.int64)
    return (idx + rank) % m + 1


def reduce_expected(start, count, op, m, nranks, dtype_name, np_dtype):
    """Exact expected reduction over all ranks, cast to the benchmark dtype."""
    import numpy as np
    if op == "prod":
        # rank_pattern puts exactly one 2 per element on one rank: the product is 2
        acc = np.full(count, 2, dtype=np.int64)
        return acc.astype(np.float64).astype(np_dtype) if dtype_name in FLOAT_DTYPES \
            else acc.astype(np_dtype)
    acc = rank_pattern(0, start, count, op, m, nranks)
    for r in range(1, nranks):
        v = rank_pattern(r, start, count, op, m, nranks)
        if op in ("sum", "average"):
            acc = acc + v
        elif op == "min":
            acc = np.minimum(acc, v)
        elif op == "max":
            acc = np.maximum(acc, v)
    if op == "average":
        wide = np.float64 if dtype_name == "float64" else np.float32
        res = acc.astype(wide) * wide(1.0 / nranks)
        return res.astype(np_dtype)
    if dtype_name in FLOAT_DTYPES:
        return acc.astype(np.float64).astype(np_dtype)
    return acc.astype(np_dtype)


def count_wrong(got, expected):
    import numpy as np
    g = np.ascontiguousarray(got).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    if g.size != e.size:
        return max(g.size, e.size)
    if g.dtype != e.dtype:
        return g.size
    # bitwise compare (exact results; NaN counts as wrong)
    width = g.dtype.itemsize
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return int(np.count_nonzero(g.view(view) != e.view(view)))


# --------------------------------------------------------------------------- buffers


class Buffers:
    """Arrays of one (case, collective, mode) for gradsync and the baselines."""

    def __init__(self, ctx, case):
        import numpy as np
        self.ctx = ctx
        self.case = case
        n = ctx.nranks
        coll = ctx.collective
        self.in_counts, self.out_counts = [], []
        for c in case.counts:
            if coll == "allgather":
                self.in_counts.append(c // n)
                self.out_counts.append(c)
            elif coll == "reduce_scatter":
                self.in_counts.append(c)
                self.out_counts.append(c // n)
            else:
                self.in_counts.append(c)
                self.out_counts.append(c)
        # global element offsets of each tensor in the logical concatenation
        self.offsets = []
        off = 0
        for c in case.counts:
            self.offsets.append(off)
            off += c
        shapes = case.shapes if coll in ("allreduce", "broadcast") else None
        self.inputs = self._alloc(self.in_counts, shapes, ctx.alloc)
        self.m = value_range(ctx.dtype_name, ctx.op, n)
        self.fill_inputs(self.inputs)
        self._np = np

    def _alloc(self, counts, shapes, alloc):
        import numpy as np
        dt = self.ctx.np_dtype
        if alloc == "contiguous":
            flat = np.empty(sum(counts), dtype=dt)
            out, off = [], 0
            for i, c in enumerate(counts):
                a = flat[off:off + c]
                out.append(a.reshape(shapes[i]) if shapes else a)
                off += c
            return out
        out = []
        for i, c in enumerate(counts):
            out.append(np.empty(shapes[i] if shapes else (c,), dtype=dt))
        return out

    def input_values(self, i):
        """int64 values this rank's input tensor i holds before a checked call."""
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        r, n = ctx.rank, ctx.nranks
        start, c = self.offsets[i], self.case.counts[i]
        if coll == "broadcast":
            if r == ctx.root:
                return np.arange(start, start + c, dtype=np.int64) % 13 + 1
            return np.zeros(c, dtype=np.int64)
        if coll == "allgather":
            b = c // n
            return np.arange(start + r * b, start + (r + 1) * b, dtype=np.int64) % 13 + 1
        return rank_pattern(r, start, c, ctx.op, self.m, n)

    def expected_output(self, i):
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        start, c = self.offsets[i], self.case.counts[i]
        dt = ctx.np_dtype
        if coll in ("broadcast", "allgather"):
            vals = np.arange(start, start + c, dtype=np.int64) % 13 + 1
            return vals.astype(np.float64).astype(dt) if ctx.dtype_name in FLOAT_DTYPES \
                else vals.astype(dt)
        full = reduce_expected(start, c, ctx.op, self.m, ctx.nranks, ctx.dtype_name, dt)
        if coll == "reduce_scatter":
            b = c // ctx.nranks
            return full[ctx.rank * b:(ctx.rank + 1) * b]
        return full

    def _cast(self, vals):
        import numpy as np
        if self.ctx.dtype_name in FLOAT_DTYPES:
            return vals.astype(np.float64).astype(self.ctx.np_dtype)
        return vals.astype(self.ctx.np_dtype)

    def fill_inputs(self, arrays):
        for i, a in enumerate(arrays):
            a.reshape(-1)[...] = self._cast(self.input_values(i))


def mpi_type(MPI, dtype_name):
    return {
        "float16": MPI.SHORT, "bfloat16": MPI.SHORT,
        "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
        "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
        "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    }[dtype_name]


def mpi_spec(MPI, arr, dtype_name):
    import numpy as np
    a = arr.reshape(-1)
    if dtype_name in HALF_DTYPES:
        a = a.view(np.int16)  # ml_dtypes arrays do not export a buffer of their own
    return [a, mpi_type(MPI, dtype_name)]


# --------------------------------------------------------------------------- context


class Ctx:
    pass


class Progress:
    def __init__(self, enabled):
        self.enabled = enabled
        self.width = 0

    def show(self, text):
        if not self.enabled:
            return
        line = "[gsbench] " + text
        pad = max(0, self.width - len(line))
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()
        self.width = len(line)

    def clear(self):
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def measure(ctx, fns, label):
    """Times each of ``fns`` (name -> zero-argument callable), interleaved.

    Every callable gets its warmup, then each repeat times all of them in turn
    (a barrier, ``iters`` back-to-back calls, the mean per call, the maximum
    over ranks), so a burst of outside load hits every candidate alike.
    Returns name -> (median over repeats in seconds, list of samples).
    """
    MPI = ctx.MPI
    for fn in fns.values():
        for _ in range(ctx.warmup):
            fn()
    samples = {name: [] for name in fns}
    for rep in range(ctx.repeats):
        for name, fn in fns.items():
            ctx.progress.show("%s %s repeat %d/%d" % (label, name, rep + 1, ctx.repeats))
            ctx.mpicomm.Barrier()
            t0 = time.perf_counter()
            for _ in range(ctx.iters):
                fn()
            dt = (time.perf_counter() - t0) / ctx.iters
            samples[name].append(ctx.mpicomm.allreduce(dt, op=MPI.MAX))
    return {name: (statistics.median(v), v) for name, v in samples.items()}


def baseline_supported(ctx):
    if ctx.baseline != "mpi4py":
        return False
    if ctx.collective in REDUCING and ctx.dtype_name in HALF_DTYPES:
        return False  # MPI cannot reduce float16/bfloat16
    return True


def mpi_op(ctx):
    MPI = ctx.MPI
    return {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN,
            "max": MPI.MAX, "prod": MPI.PROD}[ctx.op]


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
    raise ValueError(coll)


def baseline_call(ctx, bufs, mode, fused):
    """mpi4py: one call per tensor (fused=False) or one call on one buffer (fused=True)."""
    import numpy as np
    MPI, mc, coll, dn = ctx.MPI, ctx.basecomm, ctx.collective, ctx.dtype_name
    n = ctx.nranks
    if fused:
        ins = [np.empty(sum(bufs.in_counts), dtype=ctx.np_dtype)]
        outc = [sum(bufs.out_counts)]
    else:
        ins = bufs.inputs
        outc = bufs.out_counts
    ins_flat = [a.reshape(-1) for a in ins]
    if fused:
        ins_flat[0][...] = 1 if dn not in HALF_DTYPES else 0
    outs = [np.empty(c, dtype=ctx.np_dtype) for c in outc]
    scale = ctx.op == "average"
    inv = 1.0 / n
    op = mpi_op(ctx) if coll in REDUCING else None
    if coll == "allreduce":
        if mode == "in-place":
            specs = [mpi_spec(MPI, a, dn) for a in ins_flat]
            if scale:
                def f():
                    for s, a in zip(specs, ins_flat):
                        mc.Allreduce(MPI.IN_PLACE, s, op)
                        np.multiply(a, inv, out=a)
                return f

            def f():
                for s in specs:
                    mc.Allreduce(MPI.IN_PLACE, s, op)
            return f
        pairs = [(mpi_spec(MPI, a, dn), mpi_spec(MPI, o, dn)) for a, o in zip(ins_flat, outs)]
        if scale:
            def f():
                for (s, d), o in zip(pairs, outs):
                    mc.Allreduce(s, d, op)
                    np.multiply(o, inv, out=o)
            return f

        def f():
            for s, d in pairs:
                mc.Allreduce(s, d, op)
        return f
    if coll == "broadcast":
        root = ctx.root
        if mode == "in-place":
            specs = [mpi_spec(MPI, a, dn) for a in ins_flat]

            def f():
                for s in specs:
                    mc.Bcast(s, root)
            return f
        triples = [(a, o, mpi_spec(MPI, o, dn)) for a, o in zip(ins_flat, outs)]
        is_root = ctx.rank == root

        def f():
            for a, o, d in triples:
                if is_root:
                    np.copyto(o, a)
                mc.Bcast(d, root)
        return f
    if coll == "allgather":
        pairs = [(mpi_spec(MPI, a, dn), mpi_spec(MPI, o, dn)) for a, o in zip(ins_flat, outs)]

        def f():
            for s, d in pairs:
                mc.Allgather(s, d)
        return f
    if coll == "reduce_scatter":
        pairs = [(mpi_spec(MPI, a, dn), mpi_spec(MPI, o, dn)) for a, o in zip(ins_flat, outs)]
        if scale:
            def f():
                for (s, d), o in zip(pairs, outs):
                    mc.Reduce_scatter_block(s, d, op)
                    np.multiply(o, inv, out=o)
            return f

        def f():
            for s, d in pairs:
                mc.Reduce_scatter_block(s, d, op)
        return f
    raise ValueError(coll)


def check_gradsync(ctx, bufs, mode):
    """One checked iteration; the number of wrong elements summed over ranks."""
    bufs.fill_inputs(bufs.inputs)
    wrong = 0
    try:
        ref = [None]
        gradsync_call(ctx, bufs, mode, ref)()
        if mode == "in-place":
            results = bufs.inputs
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
        bufs.fill_inputs(bufs.inputs)
    return ctx.mpicomm.allreduce(wrong, op=ctx.MPI.SUM)


# --------------------------------------------------------------------------- rows


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
    bufs = Buffers(ctx, case)
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
        if do_base:
            fns["mpi4py"] = baseline_call(ctx, bufs, mode, fused=False)
            if case.ntensors > 1:
                fns["fused1"] = baseline_call(ctx, bufs, mode, fused=True)
        got = measure(ctx, fns, "%s %s" % (size_label, mode))
        ref[0] = None
        t, samples = got["gradsync"]
        res["time_us"] = t * 1e6
        res["samples_us"] = [s * 1e6 for s in samples]
        res["algbw"] = row["size"] / t / 1e9 if t > 0 else 0.0
        res["busbw"] = res["algbw"] * factor
        if do_base:
            tb, sb = got["mpi4py"]
            # one tensor: the per-tensor loop IS one call on one buffer
            tf, sf = got.get("fused1", got["mpi4py"])
            res["mpi4py_us"] = tb * 1e6
            res["mpi4py_samples_us"] = [s * 1e6 for s in sb]
            res["ratio_mpi4py"] = t / tb if tb > 0 else None
            res["fused1_us"] = tf * 1e6
            res["fused1_samples_us"] = [s * 1e6 for s in sf]
            res["ratio_fused1"] = t / tf if tf > 0 else None
        elif ctx.baseline == "mpi4py":
            res["mpi4py_us"] = res["fused1_us"] = None
            res["ratio_mpi4py"] = res["ratio_fused1"] = None
        row[key] = res
    return row


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
        blk1 += " %10s %6s %10s %6s" % ("mpi4py", "ratio", "fused1", "ratio")
        blk2 += " %10s %6s %10s %6s" % ("(us)", "gs/mpi", "(us)", "gs/f1")
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
            s += " " + fmt_num(r.get("mpi4py_us"), 10, ".2f")
            s += " " + fmt_num(r.get("ratio_mpi4py"), 6, ".3f")
            s += " " + fmt_num(r.get("fused1_us"), 10, ".2f")
            s += " " + fmt_num(r.get("ratio_fused1"), 6, ".3f")
    return s


def human(nbytes):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return "%d%s" % (nbytes // div, unit)
    return "%dB" % nbytes


def size_list(minb, maxb, factor):
    sizes = []
    s = minb
    if factor <= 1.0:
        raise SystemExit("gsbench: -f must be > 1")
    while s <= maxb:
        sizes.append(s)
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
        if minb == 0 and s == 0:
            s = 1
    return sizes


# --------------------------------------------------------------------------- metadata


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


# --------------------------------------------------------------------------- main


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
        if ctx.baseline == "mpi4py":
            for key, name in (("oop", "out-of-place"), ("ip", "in-place")):
                rs = [r[key]["ratio_mpi4py"] for r in rows
                      if r.get(key) and r[key].get("ratio_mpi4py")]
                fs = [r[key]["ratio_fused1"] for r in rows
                      if r.get(key) and r[key].get("ratio_fused1")]
                if rs:
                    ctx.out("# %s: gradsync/mpi4py time ratio median %.3f (min %.3f max %.3f);"
                            " gradsync/fused1 median %.3f"
                            % (name, statistics.median(rs), min(rs), max(rs),
                               statistics.median(fs)))
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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
