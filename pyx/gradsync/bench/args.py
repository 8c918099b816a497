"""gsbench constants, command-line flags and size lists."""

import argparse
import os

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
OPS = ("sum", "average", "min", "max", "prod", "adasum")
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter",
               "allgather_shards", "reduce_scatter_shards", "accumulate")
# The ZeRO collectives over gs.ShardLayout (in place only).
SHARDED = ("allgather_shards", "reduce_scatter_shards")
# Collectives that reduce (op matters), those with an in-place variant, and
# those that have nothing but an in-place form.
REDUCING = ("allreduce", "reduce_scatter", "reduce_scatter_shards")
INPLACE_ONLY = SHARDED + ("accumulate",)
HAS_INPLACE = ("allreduce", "broadcast") + INPLACE_ONLY
MODES = ("out-of-place", "in-place")
SHAPES_FILES = (
    # $GRADSYNC_SHAPES_FILE, else the copy shipped with this package (the
    # project's shared/data/gradient_shapes.json, taken verbatim).
    os.environ.get("GRADSYNC_SHAPES_FILE"),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "gradient_shapes.json"),
)


def busbw_factor(collective, nranks):
    """The nccl-tests bus-bandwidth factor of ``collective`` on ``nranks`` ranks."""
    if collective == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in ("allgather", "reduce_scatter") + SHARDED:
        return (nranks - 1) / nranks
    return 1.0  # broadcast; accumulate (a local kernel: busbw = algbw)


def moved_bytes(collective, nbytes, count, itemsize):
    """The bytes algbw divides by: the row's size, except for accumulate,
    where it is the memory traffic of acc(float32) += grad: 4 B read and 4 B
    written of acc plus ``itemsize`` read of grad per element."""
    if collective == "accumulate":
        return count * (8 + itemsize)
    return nbytes


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
        raise argparse.ArgumentTypeError(
            "bad size %r (use e.g. 8, 1K, 64M, 1G)" % text) from None
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
                   help="reduction op (default sum; adasum: allreduce of float dtypes only)")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root rank of broadcast (default 0)")
    p.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                   help="collective to benchmark (default allreduce); allgather_shards and "
                        "reduce_scatter_shards are the ZeRO collectives over gs.ShardLayout, "
                        "accumulate is gs.accumulate_ (float32 acc += grad of -d's dtype)")
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
                   help="also time plain mpi4py (per-tensor loop and one fused buffer); "
                        "with -o adasum: a NumPy + mpi4py Adasum and gradsync's op=sum; "
                        "shard collectives: one mpi4py Allgather/Reduce_scatter_block on "
                        "the padded flat buffer, without and with NumPy packing; "
                        "accumulate: a NumPy loop of acc += grad.astype(float32)")
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
                   help="plot busbw and time against size, gradsync and baselines, to "
                        "FILE (PNG; needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


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
