"""gsbench baselines: plain mpi4py calls (per tensor and one fused buffer), and for
op=adasum a NumPy + mpi4py Adasum and gradsync's own op=sum."""

import numpy as np

from gradsync.bench.args import HALF_DTYPES, REDUCING, SHARDED
from gradsync.bench.data import count_wrong, rank_pattern, reduce_expected


def _per_pair(call, op, ins, outs, dn, MPI, inv=None):
    """A timed function making one out-of-place mpi4py call per (input,
    output) pair; with `inv` (average), each output is then scaled by it."""
    pairs = [(mpi_spec(MPI, a, dn), mpi_spec(MPI, o, dn), o) for a, o in zip(ins, outs)]
    if inv is None:
        def f():
            for s, d, _ in pairs:
                call(s, d, op)
        return f

    def f():
        for s, d, o in pairs:
            call(s, d, op)
            np.multiply(o, inv, out=o)
    return f


def mpi_type(MPI, dtype_name):
    return {
        "float16": MPI.SHORT, "bfloat16": MPI.SHORT,
        "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
        "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
        "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    }[dtype_name]


def mpi_spec(MPI, arr, dtype_name):
    a = arr.reshape(-1)
    if dtype_name in HALF_DTYPES:
        a = a.view(np.int16)  # ml_dtypes arrays do not export a buffer of their own
    return [a, mpi_type(MPI, dtype_name)]


def baseline_supported(ctx):
    if ctx.baseline != "mpi4py":
        return False
    if ctx.op == "adasum" or ctx.collective == "accumulate":
        return True  # the NumPy Adasum and accumulate take every float dtype
    if ctx.collective in REDUCING and ctx.dtype_name in HALF_DTYPES:
        return False  # MPI cannot reduce float16/bfloat16
    return True


def baseline_columns(ctx):
    """(key, column title, ratio title) of the baseline columns; the key
    names the callable in measure(), the JSON fields KEY_us, ratio_KEY, and
    the baseline's own table."""
    if ctx.op == "adasum":
        return (("numpy", "np+mpi", "a/np"), ("gssum", "gs sum", "a/sum"))
    if ctx.collective in SHARDED:
        return (("mpi4py", "mpi4py", "gs/mpi"), ("packed", "mpi+pack", "gs/pk"))
    if ctx.collective == "accumulate":
        return (("numpy", "numpy", "gs/np"),)
    return (("mpi4py", "mpi4py", "gs/mpi"), ("fused1", "fused1", "gs/f1"))


def baseline_descriptions(ctx):
    """One line per baseline column: what it runs."""
    coll = ctx.collective
    if ctx.op == "adasum":
        return ["np+mpi: one mpi4py Allgather of the packed list + the Adasum tree per tensor "
                "in NumPy float64", "gs sum: gradsync op=sum of a copy of the same list"]
    if coll == "allgather_shards":
        return ["mpi4py: one Allgather(IN_PLACE) of the padded flat buffer (ShardLayout.padded "
                "elements; the tensors already live in it)",
                "mpi+pack: the same after NumPy copies this rank's tensors in, then copies "
                "every tensor back out"]
    if coll == "reduce_scatter_shards":
        return ["mpi4py: one Reduce_scatter_block of the padded flat buffer into a "
                "rank_count-element block%s" % (", then a NumPy multiply by 1/n"
                                                 if ctx.op == "average" else ""),
                "mpi+pack: the same after NumPy copies every tensor in, then copies the "
                "tensors this rank owns back out"]
    if coll == "accumulate":
        return ["numpy: a Python loop of acc += grad.astype(np.float32) over the tensors"]
    call = {"allreduce": "Allreduce", "broadcast": "Bcast", "allgather": "Allgather",
            "reduce_scatter": "Reduce_scatter_block"}[coll]
    return ["mpi4py: one mpi4py %s per tensor" % call,
            "fused1: ONE mpi4py %s of one pre-fused buffer of the total size (with one "
            "tensor: the mpi4py call itself)" % call]


def mpi_op(ctx):
    MPI = ctx.MPI
    return {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN,
            "max": MPI.MAX, "prod": MPI.PROD}[ctx.op]


def _tensor_check(bufs, f, results, inputs=None, prepare=None):
    """Gives ``f`` its ``check()``: one call on the check values (after
    ``prepare()``), returning the wrong elements of ``results`` on this rank
    (plus changed elements of ``inputs``: an out-of-place call must leave
    them alone). Inputs go back to their check values afterwards."""
    def check():
        bufs.reset()
        try:
            if prepare is not None:
                prepare()
            f()
            w = sum(count_wrong(o, bufs.expected_output(i)) for i, o in enumerate(results))
            for i, a in enumerate(inputs or ()):
                w += count_wrong(a, bufs._cast(bufs.input_values(i)))
            return w
        finally:
            bufs.reset()
    f.check = check
    return f


def _buffer_check(f, inbuf, result, values, expected, timing_value):
    """``check()`` of a baseline that works on one flat buffer: ``inbuf``
    takes ``values``, one call, ``result`` against ``expected`` (and, when
    the result is elsewhere, ``inbuf`` unchanged), then ``inbuf`` takes
    ``timing_value`` again."""
    def check():
        try:
            inbuf[...] = values
            f()
            w = count_wrong(result, expected)
            if result is not inbuf:
                w += count_wrong(inbuf, values)
            return w
        finally:
            inbuf[...] = timing_value
    f.check = check
    return f


def baseline_call(ctx, bufs, mode, fused):
    """mpi4py: one call per tensor (fused=False) or one call on one buffer
    (fused=True). The callable's ``check()`` counts its wrong elements."""
    if fused:
        ins_flat = [np.empty(sum(bufs.in_counts), dtype=ctx.np_dtype)]
        outc = [sum(bufs.out_counts)]
        fill = 1 if ctx.dtype_name not in HALF_DTYPES else 0
        ins_flat[0][...] = fill
    else:
        ins_flat = [a.reshape(-1) for a in bufs.inputs]
        outc = bufs.out_counts
    outs = [np.empty(c, dtype=ctx.np_dtype) for c in outc]
    f = _mpi4py_fn(ctx, ins_flat, outs, mode)
    results = ins_flat if mode == "in-place" else outs
    if fused:
        return _buffer_check(f, ins_flat[0], results[0], bufs._cast(bufs.fused_input()),
                             bufs.fused_expected(), fill)
    return _tensor_check(bufs, f, results, None if mode == "in-place" else bufs.inputs)


def _mpi4py_fn(ctx, ins_flat, outs, mode):
    MPI, mc, coll, dn = ctx.MPI, ctx.basecomm, ctx.collective, ctx.dtype_name
    n = ctx.nranks
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
        return _per_pair(mc.Allreduce, op, ins_flat, outs, dn, MPI, inv if scale else None)
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
        return _per_pair(mc.Reduce_scatter_block, op, ins_flat, outs, dn, MPI,
                         inv if scale else None)
    raise ValueError(coll)


# ------------------------------------------------------------------ shard collectives

def shard_baseline_call(ctx, bufs, packed):
    """The plain mpi4py equivalent of a shard collective: ONE Allgather
    (IN_PLACE) or Reduce_scatter_block on a flat buffer of ShardLayout.padded
    elements, rank r's block being elements [r*rank_count, (r+1)*rank_count).
    ``packed``: the tensors are copied into that buffer with NumPy first and
    the results copied back out (what a framework without gradsync does);
    otherwise the tensors are taken to live in the buffer already."""
    MPI, mc, dn, coll = ctx.MPI, ctx.basecomm, ctx.dtype_name, ctx.collective
    lay, r, n = bufs.layout, ctx.rank, ctx.nranks
    padded, rc = int(lay.padded), int(lay.rank_count)
    total = bufs.case.total
    buf = np.zeros(padded, dtype=ctx.np_dtype)
    flat = [t.reshape(-1) for t in bufs.inputs]
    views = [buf[o:o + c] for o, c in zip(bufs.offsets, bufs.case.counts)]
    mine = [i for i in range(len(flat)) if bufs.owners[i] == r]
    if coll == "allgather_shards":
        spec = mpi_spec(MPI, buf, dn)
        if not packed:
            def f():
                mc.Allgather(MPI.IN_PLACE, spec)
            values = np.zeros(padded, dtype=ctx.np_dtype)
            values[:total] = bufs._cast(bufs.fused_input())
            expected = np.zeros(padded, dtype=ctx.np_dtype)
            expected[:total] = bufs._cast(np.arange(total, dtype=np.int64) % 13 + 1)
            return _buffer_check(f, buf, buf, values, expected, 0)
        pack = [(views[i], flat[i]) for i in mine]
        unpack = [(flat[i], views[i]) for i in range(len(flat)) if i not in mine]

        def f():
            for d, s in pack:
                d[...] = s
            mc.Allgather(MPI.IN_PLACE, spec)
            for d, s in unpack:
                d[...] = s
        return _tensor_check(bufs, f, bufs.inputs)
    # reduce_scatter_shards
    op = mpi_op(ctx)
    recv = np.empty(rc, dtype=ctx.np_dtype)
    sspec, rspec = mpi_spec(MPI, buf, dn), mpi_spec(MPI, recv, dn)
    inv = 1.0 / n if ctx.op == "average" else None

    def reduce():
        mc.Reduce_scatter_block(sspec, rspec, op)
        if inv is not None:
            np.multiply(recv, inv, out=recv)
    if not packed:
        def f():
            reduce()
        # the check pattern runs on into the padding
        values = bufs._cast(rank_pattern(r, 0, padded, ctx.op, bufs.m, n))
        expected = reduce_expected(r * rc, rc, ctx.op, bufs.m, n, dn, ctx.np_dtype)
        return _buffer_check(f, buf, recv, values, expected, 0)
    pack = list(zip(views, flat))
    unpack = [(flat[i], recv[bufs.offsets[i] - r * rc:bufs.offsets[i] - r * rc
                             + bufs.case.counts[i]]) for i in mine]

    def f():
        for d, s in pack:
            d[...] = s
        reduce()
        for d, s in unpack:
            d[...] = s
    return _tensor_check(bufs, f, bufs.inputs)


# ----------------------------------------------------------------------- accumulate

def accumulate_baseline_call(ctx, bufs):
    """NumPy: ``acc += grad.astype(np.float32)`` for each pair, in a Python loop,
    on accumulators of its own (same shapes) and the same gradients."""
    accs = bufs._alloc(bufs.in_counts, bufs.case.shapes, ctx.alloc, np.dtype(np.float32))
    bufs.fill_accs(accs)
    pairs = list(zip(accs, bufs.inputs))

    def f():
        for a, g in pairs:
            a += g.astype(np.float32)
    return _tensor_check(bufs, f, accs, bufs.inputs, prepare=lambda: bufs.fill_accs(accs))


# --------------------------------------------------------------------------- adasum

# docs/GUIDE.md section 5: a squared norm below sqrt(DBL_MIN) gives coefficient 1
_NORM_THRESHOLD = 2.2250738585072014e-308 ** 0.5


def adasum_pair(a, b):
    """adasum(a, b) = ca*a + cb*b for two float64 vectors, dots in float64.

    The dots use np.einsum, single-threaded like one gradsync rank: np.dot goes
    to a threaded BLAS, whose threads from every rank fight over the cores
    (with OpenBLAS' default threads at 2 ranks on 2 cores this baseline was 6x
    slower than with OPENBLAS_NUM_THREADS=1).
    """
    import numpy as np
    dot = float(np.einsum("i,i->", a, b))
    na = float(np.einsum("i,i->", a, a))
    nb = float(np.einsum("i,i->", b, b))
    ca = 1.0 - dot / (2.0 * na) if na >= _NORM_THRESHOLD else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= _NORM_THRESHOLD else 1.0
    return ca * a + cb * b


def adasum_tree(vecs):
    """Adasum of one tensor over ranks (vecs[r] = rank r's float64 vector).

    Q = the largest power of two <= P: h_i = adasum(g_i, g_{Q+i}) for i < P-Q,
    h_i = g_i for the other i < Q; then pairs (0,1), (2,3), ..., then pairs of
    pairs, until one vector is left.
    """
    p = len(vecs)
    q = 1
    while q * 2 <= p:
        q *= 2
    h = [adasum_pair(vecs[i], vecs[q + i]) if i < p - q else vecs[i] for i in range(q)]
    while len(h) > 1:
        h = [adasum_pair(h[k], h[k + 1]) for k in range(0, len(h), 2)]
    return h[0]


def adasum_baseline_call(ctx, bufs, mode):
    """A straightforward NumPy + mpi4py Adasum of the list (on a copy of the inputs).

    Each call packs the rank's tensors into one buffer in their own dtype, does
    ONE mpi4py Allgather of it, then computes the Adasum tree of every tensor
    locally in NumPy float64 and stores it in the tensor's dtype (in place, or
    into preallocated outputs). The callable's ``outputs`` are its results.
    """
    import numpy as np
    MPI, mc, dn, n = ctx.MPI, ctx.basecomm, ctx.dtype_name, ctx.nranks
    ins = [a.copy() for a in bufs.inputs]
    outs = ins if mode == "in-place" else [np.empty_like(a) for a in ins]
    counts = bufs.in_counts
    total = sum(counts)
    send = np.empty(total, dtype=ctx.np_dtype)
    recv = np.empty(n * total, dtype=ctx.np_dtype)
    sspec, rspec = mpi_spec(MPI, send, dn), mpi_spec(MPI, recv, dn)
    gathered = recv.reshape(n, total)
    slices = []
    off = 0
    for c in counts:
        slices.append((off, off + c))
        off += c

    def f():
        for a, (lo, hi) in zip(ins, slices):
            send[lo:hi] = a.reshape(-1)
        mc.Allgather(sspec, rspec)
        for o, (lo, hi) in zip(outs, slices):
            vecs = [gathered[r, lo:hi].astype(np.float64) for r in range(n)]
            o.reshape(-1)[...] = adasum_tree(vecs).astype(ctx.np_dtype)
    f.outputs = outs

    def check():
        for i, a in enumerate(ins):
            a.reshape(-1)[...] = bufs._cast(bufs.input_values(i))
        f()
        return sum(count_wrong(o, bufs.expected_output(i)) for i, o in enumerate(outs))
    f.check = check
    return f


def gs_sum_call(ctx, bufs, mode):
    """gradsync's own op=sum allreduce of a copy of the same list; its
    ``check()`` compares with the exact sum of the adasum check pattern."""
    comm = ctx.gscomm
    copies = bufs._alloc(bufs.in_counts, bufs.case.shapes, ctx.alloc)  # same layout
    for c, a in zip(copies, bufs.inputs):
        c[...] = a
    ref = [None]
    if mode == "in-place":
        def f():
            comm.allreduce_(copies, "sum")
    else:
        def f():
            ref[0] = comm.allreduce(copies, "sum")

    def check():
        bufs.fill_inputs(copies)
        f()
        results = copies if mode == "in-place" else ref[0]
        w = sum(count_wrong(o, bufs.adasum_sum_expected(i)) for i, o in enumerate(results))
        ref[0] = None
        return w
    f.check = check
    return f
