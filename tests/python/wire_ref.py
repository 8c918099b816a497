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


def _exponents(m, fmax):
    """block_exponent of every block at once, from each block's max|finite| m
    (float64, >= 0). m and fmax * 2^s share a binade when s is the difference
    of their frexp exponents, so the smallest s with m <= fmax * 2^s is that
    difference, or one more where m's mantissa is the larger: no search."""
    mant, e = np.frexp(m)
    fmant, fe = math.frexp(fmax)
    s = e - fe + (mant > fmant)
    return np.where(m == 0.0, 0, np.maximum(s, -127))


def block_exponent(block, fmax):
    """The smallest s with max|finite| <= fmax * 2^s, clamped to E8M0's -127."""
    fin = np.abs(block[np.isfinite(block)]).astype(np.float64)
    m = float(fin.max()) if fin.size else 0.0
    return int(_exponents(np.array([m]), fmax)[0])


def quantize(x, wire):
    """float32 x as the wire carries it (decoded back to float32), blocks
    counted from x's start."""
    x = np.asarray(x, np.float32)
    if wire == "bfloat16":
        return x.astype(BF16).astype(np.float32)
    if wire == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 is inf, on the wire too
            return x.astype(np.float16).astype(np.float32)
    dt, fmax = FP8[wire]
    out = np.empty_like(x)
    if x.size == 0:
        return out
    # All blocks at once. A block is BLOCK entries along x's first axis (BLOCK
    # rows of a 2-D x): BLOCK * row contiguous floats in C order.
    run = BLOCK * (x.size // x.shape[0])
    nblocks = -(-x.size // run)
    blocks = np.zeros(nblocks * run, np.float32)
    blocks[:x.size] = x.reshape(-1)
    blocks = blocks.reshape(nblocks, run)
    # the zeros padding a partial last block change no block's max|finite|
    m = np.where(np.isfinite(blocks), np.abs(blocks), np.float32(0)).max(axis=1)
    s = _exponents(m.astype(np.float64), fmax)[:, None]
    # in float64, 2^-s and 2^s scale exactly: no float32 leaves its range there,
    # so only the casts to dt and back to float32 round
    q = blocks.astype(np.float64) * np.ldexp(1.0, -s)
    q = q.astype(dt).astype(np.float64) * np.ldexp(1.0, s)
    out[...] = q.reshape(-1)[:x.size].reshape(x.shape).astype(np.float32)
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
    with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as the runtime's sum makes it
        for d in dec[1:]:
            acc = acc + d
    if op == "average":
        acc = acc * np.float32(1.0 / len(per_rank))
    return quantize(acc, wire).astype(dtype)
