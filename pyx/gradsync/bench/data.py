"""gsbench data: tensor lists (cases), exact check patterns, buffers."""

import json
import os

from gradsync.bench.args import FLOAT_DTYPES, SHAPES_FILES

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


def adasum_pattern(rank, index, start, count, nranks):
    """int64 input values of ``rank`` for tensor ``index`` of an adasum check.

    Even tensors: the same values on every rank (adasum(a, a) = a exactly);
    odd tensors: each element on one rank only, 0 on the others (orthogonal
    vectors: every coefficient is 1, adasum = sum). Either way the exact result
    is ``idx % 13 + 1``, and a wrong pair formula, a missed rank or tensor
    boundaries crossed by the dot products all show up.
    """
    import numpy as np
    idx = np.arange(start, start + count, dtype=np.int64)
    vals = idx % 13 + 1
    if index % 2 == 0:
        return vals
    return np.where(idx % nranks == rank, vals, 0)


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
        if ctx.op == "adasum":
            return adasum_pattern(r, i, start, c, n)
        return rank_pattern(r, start, c, ctx.op, self.m, n)

    def expected_output(self, i):
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        start, c = self.offsets[i], self.case.counts[i]
        dt = ctx.np_dtype
        if coll in ("broadcast", "allgather") or ctx.op == "adasum":
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
