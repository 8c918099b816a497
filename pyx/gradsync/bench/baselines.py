"""gsbench baselines: plain mpi4py calls (per tensor and one fused buffer), and for
op=adasum a NumPy + mpi4py Adasum and gradsync's own op=sum."""

import numpy as np

from gradsync.bench.args import HALF_DTYPES, REDUCING



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
    import numpy as np
    a = arr.reshape(-1)
    if dtype_name in HALF_DTYPES:
        a = a.view(np.int16)  # ml_dtypes arrays do not export a buffer of their own
    return [a, mpi_type(MPI, dtype_name)]


def baseline_supported(ctx):
    if ctx.baseline != "mpi4py":
        return False
    if ctx.op == "adasum":
        return True  # the NumPy Adasum takes every float dtype
    if ctx.collective in REDUCING and ctx.dtype_name in HALF_DTYPES:
        return False  # MPI cannot reduce float16/bfloat16
    return True


def baseline_columns(ctx):
    """(key, column title, ratio title) of the two baseline columns; the key
    names the callable in measure() and the JSON fields KEY_us, ratio_KEY."""
    if ctx.op == "adasum":
        return (("numpy", "np+mpi", "a/np"), ("gssum", "gs sum", "a/sum"))
    return (("mpi4py", "mpi4py", "gs/mpi"), ("fused1", "fused1", "gs/f1"))


def mpi_op(ctx):
    MPI = ctx.MPI
    return {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN,
            "max": MPI.MAX, "prod": MPI.PROD}[ctx.op]


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


# --------------------------------------------------------------------------- adasum

# DESIGN.md section 4: a squared norm below sqrt(DBL_MIN) gives coefficient 1
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
    return f


def gs_sum_call(ctx, bufs, mode):
    """gradsync's own op=sum allreduce of a copy of the same list."""
    comm = ctx.gscomm
    copies = bufs._alloc(bufs.in_counts, bufs.case.shapes, ctx.alloc)  # same layout
    for c, a in zip(copies, bufs.inputs):
        c[...] = a
    if mode == "in-place":
        return lambda: comm.allreduce_(copies, "sum")
    ref = [None]

    def f():
        ref[0] = comm.allreduce(copies, "sum")
    return f
