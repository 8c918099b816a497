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
DistributedDataParallel on the "gradsync" backend (scripts/demo_torch_ddp.py).
Otherwise, or with ``--backend numpy``, it is the NumPy MLP described below.

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
import hashlib
import sys
import time
import traceback

import demo_model as dm
import numpy as np
from mpi4py import MPI

try:
    import gradsync as gs
except ImportError as exc:  # pragma: no cover - only when the build is missing
    if MPI.COMM_WORLD.rank == 0:
        sys.stderr.write(
            "demo: cannot import gradsync (%s).\n"
            "      build it with `make all` and run with PYTHONPATH=pyx\n" % exc)
    sys.exit(2)

N_CLASSES = 10
N_IN = 32


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
                   help="torch backend: micro-batches accumulated per step (default 1)")
    p.add_argument("--bucket-kib", type=int, default=64,
                   help="torch backend: gradient bucket size in KiB (default 64: several "
                        "buckets for this small model, so their allreduces overlap backward)")
    p.add_argument("--min-loss-ratio", type=float, default=0.5,
                   help="fail unless final held-out loss < ratio x initial (default 0.5)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch < 1 or a.hidden < 1:
        p.error("--steps, --batch and --hidden must be positive")
    if a.check_every < 0 or a.log_every < 0:
        p.error("--check-every and --log-every must be >= 0")
    if a.backward_passes < 1 or a.bucket_kib < 1:
        p.error("--backward-passes and --bucket-kib must be positive")
    return a


def torch_backend(args):
    """scripts/demo_torch.py's train(), or None for the NumPy demo."""
    if args.backend == "numpy":
        return None
    if args.backend == "torch-ddp":
        import demo_torch_ddp
        return demo_torch_ddp.train
    try:
        import demo_torch
    except ImportError as exc:
        if args.backend == "torch":
            raise
        if MPI.COMM_WORLD.rank == 0:
            print("demo: PyTorch is not importable (%s): running the NumPy MLP" % exc,
                  flush=True)
        return None
    return demo_torch.train


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0


def fmt_rate(bytes_, seconds):
    if seconds <= 0:
        return "n/a"
    r = bytes_ / seconds
    if r >= 1e9:
        return "%.2f GB/s" % (r / 1e9)
    return "%.1f MB/s" % (r / 1e6)


def weights_digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p).view(np.uint8).data)
    return h.digest()


def gather_digests(comm, params):
    """SHA-256 of this rank's weights, gathered from every rank.

    Gathered twice: through gradsync (the library under demonstration) and through
    plain mpi4py (an independent path).  Returns (list of digests, problem or None).
    """
    mine = weights_digest(params)
    via_gs = comm.allgather(np.frombuffer(mine, dtype=np.uint8).copy())
    via_gs = np.asarray(via_gs).reshape(comm.size, len(mine))
    via_gs = [bytes(row) for row in via_gs]
    via_mpi = MPI.COMM_WORLD.allgather(mine)
    problem = None
    if via_gs != via_mpi:
        problem = "gradsync allgather of the digests disagrees with mpi4py's allgather"
    return via_mpi, problem


def evaluate(comm, params, x, y, buf):
    """Held-out (mean loss, accuracy) over the whole test set, every rank its shard."""
    loss_sum, correct = dm.evaluate(params, x, y)
    buf[:] = (loss_sum, correct, len(y))
    comm.allreduce_(buf, op="sum")
    return buf[0] / buf[2], buf[1] / buf[2]


def mpi_library_line(info):
    """The MPI library line of gs.build_info(), whatever the key is called."""
    keys = [k for k in info if "mpi" in str(k).lower()]
    keys.sort(key=lambda k: (0 if "lib" in str(k).lower() else 1, str(k)))
    for k in keys:
        v = info[k]
        if v:
            return "%s: %s" % (k, " ".join(str(v).strip().splitlines()[0].split()))
    lib = MPI.Get_library_version().strip().splitlines()[0]
    return "MPI (from mpi4py, build_info has no MPI entry): %s" % " ".join(lib.split())


class Progress:
    """Rank 0's display: a \\r-refreshed bar on a TTY, plain lines otherwise."""

    def __init__(self, total, mode, log_every):
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.bar = mode == "bar"
        self.total = total
        self.every = log_every or max(1, total // 20)
        self.open_line = False

    def message(self, text):
        if self.open_line:
            sys.stdout.write("\n")
            self.open_line = False
        print(text, flush=True)

    def update(self, step, loss, acc, compute_ms, comm_ms, steps_per_s):
        total_ms = compute_ms + comm_ms
        pct = 100.0 * comm_ms / total_ms if total_ms > 0 else 0.0
        stats = ("loss %.4f  acc %5.1f%% | compute %5.2f ms  comm %5.2f ms/step "
                 "(%4.1f%%)  %4.0f steps/s"
                 % (loss, 100.0 * acc, compute_ms, comm_ms, pct, steps_per_s))
        width = len(str(self.total))
        if self.bar:
            n = 20
            filled = int(n * step / self.total)
            sys.stdout.write("\rstep %*d/%d [%s%s] %s" % (
                width, step, self.total, "#" * filled, "." * (n - filled), stats))
            sys.stdout.flush()
            self.open_line = True
            if step == self.total:
                self.close()
        elif step % self.every == 0 or step == self.total or step == 1:
            print("step %*d/%d  %s" % (width, step, self.total, stats), flush=True)

    def close(self):
        if self.open_line:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_line = False


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def train(comm, args):
    rank, size = comm.rank, comm.size
    root = rank == 0
    say = (lambda *a: print(*a, flush=True)) if root else (lambda *a: None)
    t_start = time.perf_counter()

    # Same dataset on every rank; each rank keeps its own shard.
    x_train, y_train, x_test, y_test = dm.make_dataset(args.seed, args.train_size,
                                                       args.test_size, n_in=N_IN,
                                                       n_classes=N_CLASSES)
    x_shard = np.ascontiguousarray(x_train[rank::size])
    y_shard = y_train[rank::size]
    x_test, y_test = np.ascontiguousarray(x_test[rank::size]), y_test[rank::size]
    if len(y_shard) == 0:
        raise ValueError("rank %d has no training data (--train-size too small)" % rank)

    # Weights: a DIFFERENT draw on every rank on purpose, then broadcast from rank 0.
    params = dm.init_params(np.random.default_rng([args.seed, 1, rank]), N_IN,
                            args.hidden, N_CLASSES)
    n_params = sum(p.size for p in params)
    if args.contiguous_grads:
        flat = np.empty(n_params, dtype=dm.DTYPE)
        grads, off = [], 0
        for p in params:
            grads.append(flat[off:off + p.size].reshape(p.shape))
            off += p.size
    else:
        grads = [np.empty_like(p) for p in params]
    grad_bytes = sum(g.nbytes for g in grads)

    info = gs.build_info()
    say("gradsync demo: data-parallel MLP training on %d rank%s" % (size, "" if size == 1 else "s"))
    say("  model   %d -> %d -> %d -> %d (ReLU, softmax), %s parameters in %d arrays, float32"
        % (N_IN, args.hidden, args.hidden, N_CLASSES, format(n_params, ","), len(params)))
    say("  data    10-class Gaussian blobs, %s train / %s held-out, seed %d; "
        "%s train samples per rank"
        % (format(args.train_size, ","), format(args.test_size, ","), args.seed,
           format(len(y_shard), ",")))
    say("  batch   %d per rank x %d = %d global; SGD lr %g momentum %g; %d steps"
        % (args.batch, size, args.batch * size, args.lr, args.momentum, args.steps))
    say("  comm    one fused allreduce_(grads, op=\"average\") per step: %s in %d tensors%s; "
        "fusion threshold %s"
        % (fmt_bytes(grad_bytes), len(grads),
           " (one allocation)" if args.contiguous_grads else "",
           fmt_bytes(comm.fusion_threshold)))
    say("  %s" % mpi_library_line(info))

    # -- broadcast: make the weights identical -------------------------------
    before, _ = gather_digests(comm, params)
    t0 = time.perf_counter()
    comm.broadcast_(params, root=0)
    t_bcast = time.perf_counter() - t0
    after, problem = gather_digests(comm, params)
    ok = len(set(after)) == 1 and problem is None
    say("broadcast_(params, root=0): %d distinct weight sets before, %d after (%.2f ms)%s"
        % (len(set(before)), len(set(after)), 1e3 * t_bcast,
           "" if ok else "  <-- FAILED" + (": " + problem if problem else "")))
    if not ok:
        return 1

    opt = dm.SGDMomentum(params, args.lr, args.momentum)
    ebuf = np.zeros(3, dtype=np.float64)
    init_loss, init_acc = evaluate(comm, params, x_test, y_test, ebuf)
    say("step 0: held-out loss %.4f  acc %.1f%%" % (init_loss, 100 * init_acc))

    progress = Progress(args.steps, args.progress, args.log_every) if root else None
    # [loss_sum, correct, samples, compute_s, grad_comm_s]: summed over ranks each step
    mbuf = np.zeros(5, dtype=np.float64)
    rng = np.random.default_rng([args.seed, 2, rank])
    order, cursor = rng.permutation(len(y_shard)), 0

    compute_s = grad_comm_s = metric_comm_s = 0.0
    grad_times = []
    window = [0.0, 0.0, 0, time.perf_counter()]     # compute, comm, steps, wall start
    digest_failures = []

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # local mini-batch: walk a per-rank shuffle of the shard, reshuffle per epoch
        if cursor + args.batch > len(order):
            order, cursor = rng.permutation(len(y_shard)), 0
        idx = order[cursor:cursor + args.batch]
        cursor += args.batch
        loss_sum, correct = dm.loss_and_grads(params, x_shard[idx], y_shard[idx], grads)
        t1 = time.perf_counter()
        comm.allreduce_(grads, op="average")              # <- the one fused call
        t2 = time.perf_counter()
        opt.step(params, grads)
        t3 = time.perf_counter()
        c_s, g_s = (t1 - t0) + (t3 - t2), t2 - t1
        mbuf[:] = (loss_sum, correct, len(idx), c_s, g_s)
        comm.allreduce_(mbuf, op="sum")                   # loss/accuracy over all ranks
        t4 = time.perf_counter()

        compute_s += c_s
        grad_comm_s += g_s
        metric_comm_s += t4 - t3
        grad_times.append(g_s)
        if root:
            # rank-averaged per-step times; the metrics allreduce counts as comm too
            window[0] += mbuf[3] / size
            window[1] += mbuf[4] / size + (t4 - t3)
            window[2] += 1
            now = time.perf_counter()
            show = progress.bar or step % progress.every == 0 or step in (1, args.steps)
            if show:
                n = window[2]
                progress.update(step, mbuf[0] / mbuf[2], mbuf[1] / mbuf[2],
                                1e3 * window[0] / n, 1e3 * window[1] / n,
                                n / max(now - window[3], 1e-9))
                window[:] = [0.0, 0.0, 0, now]

        if args.check_every and step % args.check_every == 0 and step != args.steps:
            loss, acc = evaluate(comm, params, x_test, y_test, ebuf)
            digests, problem = gather_digests(comm, params)
            same = len(set(digests)) == 1 and problem is None
            if not same:
                digest_failures.append(step)
            if root:
                progress.message("  check @ step %d: held-out loss %.4f  acc %.1f%%  "
                                 "weights identical: %s%s"
                                 % (step, loss, 100 * acc, "yes" if same else "NO",
                                    (" (" + problem + ")") if problem else ""))
                window[3] = time.perf_counter()   # don't bill the check to the steps

    if root:
        progress.close()

    # -- final evaluation and checks -------------------------------------------
    final_loss, final_acc = evaluate(comm, params, x_test, y_test, ebuf)
    digests, problem = gather_digests(comm, params)
    identical = len(set(digests)) == 1 and problem is None
    wall = time.perf_counter() - t_start

    # per-rank totals -> averages over ranks (and the max for the comm time)
    tot = np.array([compute_s, grad_comm_s, metric_comm_s], dtype=np.float64)
    tot_avg = comm.allreduce(tot, op="average")
    steps = args.steps
    med_grad = float(np.median(grad_times))
    loss_ok = bool(np.isfinite(final_loss)) and final_loss < args.min_loss_ratio * init_loss

    if root:
        c, g, m = tot_avg
        busy = c + g + m
        bus_factor = 2.0 * (size - 1) / size if size > 1 else 0.0
        say("")
        say("== summary (%d rank%s, %d steps, %.1f s wall) =="
            % (size, "" if size == 1 else "s", steps, wall))
        say("held-out loss     %.4f -> %.4f  (x%.3f, must be < x%g)   accuracy %.1f%% -> %.1f%%"
            % (init_loss, final_loss, final_loss / init_loss, args.min_loss_ratio,
               100 * init_acc, 100 * final_acc))
        say("compute           %7.2f s total  %6.2f ms/step  %5.1f%%"
            % (c, 1e3 * c / steps, 100 * c / busy))
        say("communication     %7.2f s total  %6.2f ms/step  %5.1f%%   "
            "(gradients %.2f ms/step, loss/acc %.2f ms/step)"
            % (g + m, 1e3 * (g + m) / steps, 100 * (g + m) / busy,
               1e3 * g / steps, 1e3 * m / steps))
        say("gradient allreduce %s/step in 1 fused call of %d tensors; median %.2f ms "
            "-> algbw %s, busbw %s"
            % (fmt_bytes(grad_bytes), len(grads), 1e3 * med_grad,
               fmt_rate(grad_bytes, med_grad),
               fmt_rate(grad_bytes * bus_factor, med_grad) if size > 1 else "n/a"))
        say("gradsync %s  simd %s  |  %s"
            % (info.get("version", getattr(gs, "__version__", "?")),
               info.get("simd_level", info.get("simd", "?")), mpi_library_line(info)))
        if digest_failures:
            say("weights differed at checks after steps: %s" % digest_failures)
        if problem:
            say("weight check problem: %s" % problem)
        say("weights identical on all %d ranks: %s  (sha256 %s)"
            % (size, "yes" if identical else "NO", digests[0].hex()[:16]))
        if not identical:
            for r, d in enumerate(digests):
                say("  rank %d: %s" % (r, d.hex()[:16]))
        if not loss_ok:
            say("FAILED: held-out loss did not fall below %g x its initial value"
                % args.min_loss_ratio)
    return 0 if (identical and loss_ok and not digest_failures) else 1


def main(argv=None):
    args = parse_args(argv)
    try:
        run = torch_backend(args) or train
        comm = gs.Communicator()       # wraps a duplicate of mpi4py's COMM_WORLD
        try:
            status = run(comm, args)
        finally:
            comm.close()
    except Exception:
        # One rank failing alone would leave the others waiting in a collective.
        sys.stderr.write("demo: rank %d failed:\n%s" % (MPI.COMM_WORLD.rank,
                                                        traceback.format_exc()))
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
