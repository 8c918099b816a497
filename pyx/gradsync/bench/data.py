"""gsbench data: tensor lists (cases), exact check patterns, buffers."""

import json
import os

from gradsync.bench.args import FLOAT_DTYPES, SHAPES_FILES, SHARDED


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


def shard_geometry(total, nranks):
    """(padded, rank_count) of gs.ShardLayout over ``total`` elements
    (docs/GUIDE.md section 2.3: align = size * 32, always adds a block)."""
    align = nranks * 32
    padded = total + align - total % align
    return padded, padded // nranks


def shard_counts(total, k, nranks):
    """``total`` elements as a valid shard list of about ``k`` tensors.

    A tensor must end inside its owner's range, so the list is first cut at
    every multiple of rank_count below ``total`` (up to ``nranks`` segments,
    the last one shorter: the padding comes off it), then each segment is
    split into nearly equal tensors, the k tensors shared out in proportion
    to the segments' lengths: k in all when k >= the segment count (else one
    tensor per segment: the fewest tensors a valid list can have) and k <= total.
    """
    _, rc = shard_geometry(total, nranks)
    cuts = [0] + [j * rc for j in range(1, nranks) if j * rc < total] + [total]
    segs = [b - a for a, b in zip(cuts, cuts[1:])]
    k = max(len(segs), min(k, total))
    parts = [max(1, min(n, (k * n) // total)) for n in segs]
    while sum(parts) < k:  # the segment whose tensors are longest takes one more
        j = max((j for j in range(len(segs)) if parts[j] < segs[j]),
                key=lambda j: segs[j] / parts[j])
        parts[j] += 1
    while sum(parts) > k:
        j = min((j for j in range(len(segs)) if parts[j] > 1),
                key=lambda j: segs[j] / parts[j])
        parts[j] -= 1
    counts = []
    for length, p in zip(segs, parts):
        counts.extend(split_counts(length, p))
    return counts


def cut_at_shards(numels, nranks):
    """A model's tensor list made valid for the shard collectives: a tensor
    that crosses a multiple of rank_count is cut there (what ZeRO
    partitioners do with a flattened parameter list)."""
    _, rc = shard_geometry(sum(numels), nranks)
    out, off = [], 0
    for n in numels:
        end = off + n
        while n > 0 and (off // rc + 1) * rc < end:
            piece = (off // rc + 1) * rc - off
            out.append(piece)
            off += piece
            n -= piece
        out.append(n)
        off = end
    return out


def make_case(collective, nbytes, itemsize, k, nranks):
    """The tensor list of one size row; None when the size is too small."""
    count = nbytes // itemsize
    if collective in SHARDED:
        return Case(shard_counts(count, k, nranks)) if count > 0 else None
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
    if collective in SHARDED:
        # flat tensors, cut where they cross a rank's range
        return Case(cut_at_shards(numels, nranks), None, label)
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


def acc_values(start, count):
    """int64 values an accumulator (float32) holds before a checked accumulate_."""
    import numpy as np
    return np.arange(start, start + count, dtype=np.int64) % 7 + 1


class Buffers:
    """Arrays of one (case, collective, mode) for gradsync and the baselines.

    ``inputs`` are the tensors the collective takes (for accumulate: the
    gradients, with ``accs`` the float32 accumulators); ``layout`` is the
    gs.ShardLayout of the shard collectives.
    """

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
        self.layout = None
        if coll in SHARDED:
            self.layout = ctx.gs.ShardLayout(case.counts, n)  # ValueError if invalid
            self.owners = [int(self.layout.owner(i)) for i in range(case.ntensors)]
        shapes = case.shapes if coll in ("allreduce", "broadcast", "accumulate") else None
        self.inputs = self._alloc(self.in_counts, shapes, ctx.alloc)
        self.accs = None
        if coll == "accumulate":
            self.accs = self._alloc(self.in_counts, shapes, ctx.alloc, np.dtype(np.float32))
        self.m = value_range(ctx.dtype_name, ctx.op, n)
        self.reset()
        self._np = np

    def _alloc(self, counts, shapes, alloc, dtype=None):
        import numpy as np
        dt = self.ctx.np_dtype if dtype is None else dtype
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

    def input_values(self, i, rank=None):
        """int64 values input tensor i of ``rank`` (default: this rank) holds
        before a checked call."""
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        r = ctx.rank if rank is None else rank
        n = ctx.nranks
        start, c = self.offsets[i], self.case.counts[i]
        pattern = np.arange(start, start + c, dtype=np.int64) % 13 + 1
        if coll == "broadcast":
            return pattern if r == ctx.root else np.zeros(c, dtype=np.int64)
        if coll == "allgather":
            b = c // n
            return pattern[r * b:(r + 1) * b]
        if coll == "allgather_shards":
            return pattern if self.owners[i] == r else np.zeros(c, dtype=np.int64)
        if coll == "accumulate":
            return (np.arange(start, start + c, dtype=np.int64) + r) % 13 + 1
        if ctx.op == "adasum":
            return adasum_pattern(r, i, start, c, n)
        return rank_pattern(r, start, c, ctx.op, self.m, n)

    def expected_output(self, i):
        """What result tensor i must hold on this rank after a checked call
        (in place: the tensor itself; accumulate: the accumulator)."""
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        start, c = self.offsets[i], self.case.counts[i]
        dt = ctx.np_dtype
        if coll in ("broadcast", "allgather", "allgather_shards") or ctx.op == "adasum":
            return self._cast(np.arange(start, start + c, dtype=np.int64) % 13 + 1)
        if coll == "accumulate":
            return (acc_values(start, c) + self.input_values(i)).astype(np.float32)
        if coll == "reduce_scatter_shards" and self.owners[i] != ctx.rank:
            return self._cast(self.input_values(i))  # left exactly as it was
        full = reduce_expected(start, c, ctx.op, self.m, ctx.nranks, ctx.dtype_name, dt)
        if coll == "reduce_scatter":
            b = c // ctx.nranks
            return full[ctx.rank * b:(ctx.rank + 1) * b]
        return full

    def adasum_sum_expected(self, i):
        """op=sum over ranks of the adasum check pattern (the 'gs sum' baseline)."""
        ctx = self.ctx
        acc = sum(self.input_values(i, r) for r in range(ctx.nranks))
        return self._cast(acc)

    def results(self):
        """The arrays an in-place call leaves its results in."""
        return self.accs if self.ctx.collective == "accumulate" else self.inputs

    # ---- one pre-fused buffer (the fused1 baseline) -----------------------
    def fused_input(self, rank=None):
        """int64 values of this rank's fused1 input: its tensors back to back."""
        import numpy as np
        n = len(self.case.counts)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.input_values(i, rank) for i in range(n)])

    def fused_expected(self):
        """The exact fused1 result on this rank, in the benchmark dtype."""
        import numpy as np
        ctx, coll = self.ctx, self.ctx.collective
        n = ctx.nranks
        if coll == "allgather":  # block q: rank q's tensors back to back
            return self._cast(np.concatenate([self.fused_input(q) for q in range(n)]))
        if coll == "reduce_scatter":  # Reduce_scatter_block cuts the fused buffer
            total = self.case.total
            b = total // n
            full = reduce_expected(0, total, ctx.op, self.m, n, ctx.dtype_name, ctx.np_dtype)
            return full[ctx.rank * b:(ctx.rank + 1) * b]
        return np.concatenate([self.expected_output(i).reshape(-1)
                               for i in range(len(self.case.counts))])

    def _cast(self, vals):
        import numpy as np
        if self.ctx.dtype_name in FLOAT_DTYPES:
            return vals.astype(np.float64).astype(self.ctx.np_dtype)
        return vals.astype(self.ctx.np_dtype)

    def fill_inputs(self, arrays):
        for i, a in enumerate(arrays):
            a.reshape(-1)[...] = self._cast(self.input_values(i))

    def fill_accs(self, arrays):
        import numpy as np
        for i, a in enumerate(arrays):
            a.reshape(-1)[...] = acc_values(self.offsets[i], self.case.counts[i]).astype(
                np.float32)

    def reset(self):
        """Inputs (and accumulators) back to their check values."""
        self.fill_inputs(self.inputs)
        if self.accs is not None:
            self.fill_accs(self.accs)
