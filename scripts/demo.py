#!/usr/bin/env python
"""gradsync demo: data-parallel training of a small MLP.

    mpiexec -n 4 python scripts/demo.py            (what `make demo` runs)
    mpiexec -n 2 python scripts/demo.py --steps 400 --hidden 128
    mpiexec -n 4 python scripts/demo.py --backend numpy
    mpiexec -n 4 python scripts/demo.py --backend torch-ddp   (torch.distributed DDP)

With PyTorch importable (``--backend auto``, the default) the model is a
torch.nn MLP trained with gradsync.torch.DistributedOptimizer, which overlaps
the gradient allreduce with the backward pass (scripts/demo_torch.py;
``--op adasum``, ``--backward-passes K`` and ``--bucket-kib`` choose how).
``--backend torch-ddp`` trains the same MLP with torch.distributed's
DistributedDataParallel on the "gradsync" backend (scripts/demo_torch.py).
Otherwise, or with ``--backend numpy``, it is the NumPy MLP described below
(scripts/demo_numpy.py). Every backend runs the one training loop of
scripts/demo_train.py: data, batches, checks, progress and the summary.

Every rank builds the same synthetic dataset (10 classes of Gaussian blobs, from
--seed) and trains on its own shard of it (rank r takes samples r, r+N, r+2N, ...).
Each step:

    1. forward/backward on the rank's local mini-batch (NumPy, float32)
    2. ONE fused gradsync call averages all gradient arrays across ranks:
           comm.allreduce_(grads, op="average")
    3. SGD with momentum, identical on every rank

The parameters start from a different random draw on every rank and are made
identical with comm.broadcast_(params, root=0), which the demo verifies.  Every
--check-every steps, and at the end, it evaluates the held-out set and checks that
all ranks hold bitwise-identical weights (a SHA-256 of the parameter bytes,
gathered with gradsync's allgather and cross-checked through plain mpi4py).

Exit status: 0 on success; 1 if the weights differ between ranks, or the held-out
loss did not fall below --min-loss-ratio x its initial value.
"""

import os

# 4 ranks on 2 cores: one BLAS thread per rank, or the ranks fight over the cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import sys
import traceback

from mpi4py import MPI

try:
    import gradsync as gs
except ImportError as exc:  # pragma: no cover - only when the build is missing
    if MPI.COMM_WORLD.rank == 0:
        sys.stderr.write(
            "demo: cannot import gradsync (%s).\n"
            "      build it with `make all` and run with PYTHONPATH=pyx\n" % exc)
    sys.exit(2)

from demo_train import train  # noqa: E402

# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Data-parallel NumPy MLP training with gradsync "
                    "(run under mpiexec -n N).")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--batch", type=int, default=64,
                   help="mini-batch size PER RANK (default 64; global batch = batch x ranks)")
    p.add_argument("--hidden", type=int, default=256,
                   help="width of both hidden layers (default 256 -> 76,810 parameters)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data and the weights")
    p.add_argument("--check-every", type=int, default=50,
                   help="every K steps: held-out evaluation + cross-rank weight check "
                        "(0: only at the end; default 50)")
    p.add_argument("--log-every", type=int, default=0,
                   help="print a progress line every K steps when not on a TTY "
                        "(default: steps/20)")
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="rank 0's progress display: a \\r bar on a TTY, lines otherwise")
    p.add_argument("--train-size", type=int, default=16384, help="training samples, all ranks")
    p.add_argument("--test-size", type=int, default=4096, help="held-out samples, all ranks")
    p.add_argument("--contiguous-grads", action="store_true",
                   help="keep all gradients as views of ONE allocation (gradsync then "
                        "reduces them in place, with no packing copy)")
    p.add_argument("--backend", choices=("auto", "torch", "torch-ddp", "numpy"),
                   default="auto",
                   help="torch: a torch.nn MLP with gradsync.torch.DistributedOptimizer; "
                        "torch-ddp: the same MLP with torch.distributed DDP on the "
                        "gradsync backend; numpy: the NumPy MLP; auto (default): torch "
                        "when it imports")
    p.add_argument("--op", choices=("average", "adasum", "sum"), default="average",
                   help="torch backend: DistributedOptimizer's op (default average)")
    p.add_argument("--backward-passes", type=int, default=1,
                   help="micro-batches per step (default 1): torch accumulates them, numpy "
                        "reduces and steps on each")
    p.add_argument("--bucket-kib", type=int, default=64,
                   help="torch backend: gradient bucket size in KiB (default 64: several "
                        "buckets for this small model, so their allreduces overlap backward)")
    p.add_argument("--wire", choices=("bfloat16", "float16", "float8_e4m3", "float8_e5m2"),
                   default=None,
                   help="gradients go on the wire in this format (float32 sums, one rounding) "
                        "with error feedback (docs/GUIDE.md 2.15); op average only")
    p.add_argument("--min-loss-ratio", type=float, default=0.5,
                   help="fail unless final held-out loss < ratio x initial (default 0.5)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch < 1 or a.hidden < 1:
        p.error("--steps, --batch and --hidden must be positive")
    if a.check_every < 0 or a.log_every < 0:
        p.error("--check-every and --log-every must be >= 0")
    if a.backward_passes < 1 or a.bucket_kib < 1:
        p.error("--backward-passes and --bucket-kib must be positive")
    if a.wire and a.op != "average":
        p.error("--wire takes --op average")
    return a


def backend(comm, args):
    """The backend --backend names (auto: torch when it imports, else NumPy)."""
    if args.backend != "numpy":
        try:
            import demo_torch
        except ImportError as exc:
            if args.backend != "auto":
                raise
            if comm.rank == 0:
                print("demo: PyTorch is not importable (%s): running the NumPy MLP" % exc,
                      flush=True)
        else:
            make = demo_torch.TorchDDP if args.backend == "torch-ddp" else \
                demo_torch.TorchOptimizer
            return make(comm, args)
    from demo_numpy import NumpyMLP

    return NumpyMLP(comm, args)


def main(argv=None):
    args = parse_args(argv)
    try:
        comm = gs.Communicator()       # a duplicate of gradsync's world: COMM_WORLD under mpiexec
        try:
            status = train(comm, args, backend(comm, args))
        finally:
            comm.close()
    except Exception:
        # One rank failing alone would leave the others waiting in a collective.
        sys.stderr.write("demo: rank %d failed:\n%s" % (gs.world().rank,
                                                        traceback.format_exc()))
        sys.stderr.flush()
        gs.world().Abort(1)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
