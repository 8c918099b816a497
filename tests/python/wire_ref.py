"""The wire allreduce's reference (gs_allreduce_wire), independent of the
library: NumPy and ml_dtypes, rank by rank. Shared by tests/python/
test_wire.py (host memory) and tests/gpu/test_device_wire.py (CUDA memory,
which must give the same bits)."""
import math
import os

import ml_dtypes
import numpy as np

from gsutil import BF16

FP8 = {"float8_e4m3": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0),
       "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 57344.0)}
BLOCK = 32


def block_exponent(block, fmax):
    """The smallest s with max|finite| <= fmax * 2^s, clamped to E8M0's -127."""
    fin = np.abs(block[np.isfinite(block)]).astype(np.float64)
    m = float(fin.max()) if fin.size else 0.0
    if m == 0.0:
        return 0
    s = math.frexp(m)[1] - math.frexp(fmax)[1]
    while math.ldexp(fmax, s) < m:
        s += 1
    while math.ldexp(fmax, s - 1) >= m:
        s -= 1
    return max(s, -127)


def quantize(x, wire):
    """float32 x as the wire carries it (decoded back to float32), blocks
    counted from x's start."""
    x = np.asarray(x, np.float32)
    if wire == "bfloat16":
        return x.astype(BF16).astype(np.float32)
    if wire == "float16":
        return x.astype(np.float16).astype(np.float32)
    dt, fmax = FP8[wire]
    out = np.empty_like(x)
    for b in range(0, x.size, BLOCK):
        blk = x[b:b + BLOCK]
        s = block_exponent(blk, fmax)
        q = (blk.astype(np.float64) * 2.0 ** -s).astype(dt).astype(np.float64) * 2.0 ** s
        out[b:b + BLOCK] = q.astype(np.float32)
    return out


def host_group(size):
    """Ranks per simulated host when the hierarchical allreduce is forced
    (GRADSYNC_HIERARCHICAL=1 GRADSYNC_HIERARCHY_SIZE=g, as the Makefile runs
    this file at 4 ranks), else 0."""
    g = int(os.environ.get("GRADSYNC_HIERARCHY_SIZE", "0") or 0)
    forced = os.environ.get("GRADSYNC_HIERARCHICAL") == "1"
    return g if forced and g > 0 and size > 1 and size % g == 0 else 0


def wire_reference(per_rank, wire, op="sum", dtype=np.float32):
    """The algorithm, rank by rank: encode, float32 sum in rank order, scale,
    round. Hierarchical: each host's float32 sum (two ranks a host: exact in
    either order) is what crosses the hosts in the wire format."""
    ins = [np.asarray(x).astype(np.float32) for x in per_rank]
    g = host_group(len(ins))
    if g:
        hosts = []
        for h in range(0, len(ins), g):
            acc = ins[h].copy()
            for x in ins[h + 1:h + g]:
                acc = acc + x
            hosts.append(acc)
        ins = hosts
    dec = [quantize(x, wire) for x in ins]
    acc = dec[0].copy()
    for d in dec[1:]:
        acc = acc + d
    if op == "average":
        acc = acc * np.float32(1.0 / len(per_rank))
    return quantize(acc, wire).astype(dtype)
