"""The demo's one training loop, for every backend (scripts/demo.py picks one).

The loop owns what the backends share: the dataset and each rank's shard,
the mini-batch order, the held-out evaluation, the cross-rank weight check,
rank 0's progress display and the summary with the communication figures.
A backend owns the model and its communication; it provides

    title, lines()              the header: what runs, the model, the comm
    replicate()                 make every rank's weights rank 0's; returns
                                the call's name (the demo checks the result)
    step(batches)               one optimizer step over ``batches`` (a list of
                                --backward-passes (x, y) NumPy pairs); returns
                                (loss_sum, correct, compute_s, comm_s)
    sums(x, y)                  (loss_sum, correct) of this rank's x, y
    weights()                   the arrays whose bytes are the weights
    summary(steps, comm_s)      its own summary lines
    comm_label                  what its comm_s measures
    close()                     the end of the run
"""
import hashlib
import sys
import time

import demo_model as dm
import numpy as np
from mpi4py import MPI

import gradsync as gs

N_CLASSES = 10
N_IN = 32


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

    def due(self, step):
        return self.bar or step % self.every == 0 or step in (1, self.total)

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
        else:
            print("step %*d/%d  %s" % (width, step, self.total, stats), flush=True)

    def close(self):
        if self.open_line:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_line = False


class Data:
    """The same dataset on every rank; each keeps its shard (rank r takes
    samples r, r+N, ...) and walks its own shuffle of it, epoch by epoch."""

    def __init__(self, args, rank, size):
        x_train, y_train, x_test, y_test = dm.make_dataset(
            args.seed, args.train_size, args.test_size, n_in=N_IN, n_classes=N_CLASSES)
        self.x = np.ascontiguousarray(x_train[rank::size])
        self.y = y_train[rank::size]
        self.x_test = np.ascontiguousarray(x_test[rank::size])
        self.y_test = y_test[rank::size]
        if len(self.y) == 0:
            raise ValueError("rank %d has no training data (--train-size too small)" % rank)
        self.batch = args.batch
        self.rng = np.random.default_rng([args.seed, 2, rank])
        self.order, self.cursor = self.rng.permutation(len(self.y)), 0

    def next_batch(self):
        if self.cursor + self.batch > len(self.order):
            self.order, self.cursor = self.rng.permutation(len(self.y)), 0
        idx = self.order[self.cursor:self.cursor + self.batch]
        self.cursor += self.batch
        return self.x[idx], self.y[idx]


class Run:
    """One rank's run: the collective checks and rank 0's output."""

    def __init__(self, comm, backend, data):
        self.comm, self.backend, self.data = comm, backend, data
        self.root = comm.rank == 0
        self.ebuf = np.zeros(3, dtype=np.float64)

    def say(self, *a):
        if self.root:
            print(*a, flush=True)

    def evaluate(self):
        """Held-out (mean loss, accuracy) over the whole test set."""
        loss_sum, correct = self.backend.sums(self.data.x_test, self.data.y_test)
        self.ebuf[:] = (loss_sum, correct, len(self.data.y_test))
        self.comm.allreduce_(self.ebuf, op="sum")
        return self.ebuf[0] / self.ebuf[2], self.ebuf[1] / self.ebuf[2]

    def digests(self):
        """SHA-256 of every rank's weights, gathered twice: through gradsync
        (the library under demonstration) and through plain mpi4py (an
        independent path). Returns (digests, problem or None)."""
        h = hashlib.sha256()
        for w in self.backend.weights():
            h.update(np.ascontiguousarray(w).view(np.uint8).data)
        mine = h.digest()
        via_gs = self.comm.allgather(np.frombuffer(mine, dtype=np.uint8).copy())
        via_gs = [bytes(row) for row in np.asarray(via_gs).reshape(self.comm.size, len(mine))]
        via_mpi = gs.world().allgather(mine)  # MPI's world, or the one torchrun's joined
        if via_gs != via_mpi:
            return via_mpi, "gradsync allgather of the digests disagrees with mpi4py's allgather"
        return via_mpi, None

    def replicate(self):
        before, _ = self.digests()
        t0 = time.perf_counter()
        call = self.backend.replicate()
        dt = time.perf_counter() - t0
        after, problem = self.digests()
        ok = len(set(after)) == 1 and problem is None
        self.say("%s: %d distinct weight sets before, %d after (%.2f ms)%s"
                 % (call, len(set(before)), len(set(after)), 1e3 * dt,
                    "" if ok else "  <-- FAILED" + (": " + problem if problem else "")))
        return ok

    def check(self, step, progress):
        loss, acc = self.evaluate()
        digests, problem = self.digests()
        same = len(set(digests)) == 1 and problem is None
        if self.root:
            progress.message("  check @ step %d: held-out loss %.4f  acc %.1f%%  "
                             "weights identical: %s%s"
                             % (step, loss, 100 * acc, "yes" if same else "NO",
                                (" (" + problem + ")") if problem else ""))
        return same


def header(run, args):
    comm, backend, data = run.comm, run.backend, run.data
    size, k = comm.size, args.backward_passes
    run.say("gradsync demo: %s on %d rank%s" % (backend.title, size, "" if size == 1 else "s"))
    for line in backend.lines()[:1]:
        run.say("  model   " + line)
    run.say("  data    10-class Gaussian blobs, %s train / %s held-out, seed %d; "
            "%s train samples per rank"
            % (format(args.train_size, ","), format(args.test_size, ","), args.seed,
               format(len(data.y), ",")))
    run.say("  batch   %d per rank x %d micro-batch%s x %d ranks = %d per step; SGD lr %g "
            "momentum %g; %d steps"
            % (args.batch, k, "" if k == 1 else "es", size, args.batch * k * size, args.lr,
               args.momentum, args.steps))
    for line in backend.lines()[1:]:
        run.say("  comm    " + line)
    run.say("  %s" % mpi_library_line(gs.build_info()))


def train(comm, args, backend):
    """Trains with ``backend``; 0 when every rank ends with the same weights
    and the held-out loss fell below --min-loss-ratio x its initial value."""
    t_start = time.perf_counter()
    size = comm.size
    data = Data(args, comm.rank, size)
    run = Run(comm, backend, data)
    header(run, args)
    if not run.replicate():
        return 1
    init_loss, init_acc = run.evaluate()
    run.say("step 0: held-out loss %.4f  acc %.1f%%" % (init_loss, 100 * init_acc))

    progress = Progress(args.steps, args.progress, args.log_every) if run.root else None
    # [loss_sum, correct, samples, compute_s, comm_s]: summed over ranks each step
    mbuf = np.zeros(5, dtype=np.float64)
    totals = np.zeros(3)                              # compute, gradient comm, metrics comm
    window = [0.0, 0.0, 0, time.perf_counter()]       # compute, comm, steps, wall start
    failures = []
    for step in range(1, args.steps + 1):
        batches = [data.next_batch() for _ in range(args.backward_passes)]
        loss_sum, correct, compute_s, comm_s = backend.step(batches)
        t0 = time.perf_counter()
        mbuf[:] = (loss_sum, correct, sum(len(y) for _, y in batches), compute_s, comm_s)
        comm.allreduce_(mbuf, op="sum")               # loss/accuracy over all ranks
        metrics_s = time.perf_counter() - t0
        totals += (compute_s, comm_s, metrics_s)
        if run.root:
            # rank-averaged per-step times; the metrics allreduce counts as comm too
            window[0] += mbuf[3] / size
            window[1] += mbuf[4] / size + metrics_s
            window[2] += 1
            now = time.perf_counter()
            if progress.due(step):
                n = window[2]
                progress.update(step, mbuf[0] / mbuf[2], mbuf[1] / mbuf[2],
                                1e3 * window[0] / n, 1e3 * window[1] / n,
                                n / max(now - window[3], 1e-9))
                window[:] = [0.0, 0.0, 0, now]
        if args.check_every and step % args.check_every == 0 and step != args.steps:
            if not run.check(step, progress):
                failures.append(step)
            window[3] = time.perf_counter()           # don't bill the check to the steps
    if run.root:
        progress.close()

    final_loss, final_acc = run.evaluate()
    digests, problem = run.digests()
    identical = len(set(digests)) == 1 and problem is None
    wall = time.perf_counter() - t_start
    c, g, m = comm.allreduce(totals, op="average")
    loss_ok = bool(np.isfinite(final_loss)) and final_loss < args.min_loss_ratio * init_loss
    steps = args.steps
    extra = backend.summary(steps, g)
    backend.close()
    if run.root:
        busy = max(c + g + m, 1e-12)
        info = gs.build_info()
        run.say("")
        run.say("== summary (%d rank%s, %d steps, %.1f s wall) =="
                % (size, "" if size == 1 else "s", steps, wall))
        run.say("held-out loss     %.4f -> %.4f  (x%.3f, must be < x%g)   "
                "accuracy %.1f%% -> %.1f%%"
                % (init_loss, final_loss, final_loss / init_loss, args.min_loss_ratio,
                   100 * init_acc, 100 * final_acc))
        run.say("compute           %7.2f s total  %6.2f ms/step  %5.1f%%"
                % (c, 1e3 * c / steps, 100 * c / busy))
        run.say("communication     %7.2f s total  %6.2f ms/step  %5.1f%%   "
                "(%s %.2f ms/step, loss/acc sums %.2f ms/step)"
                % (g + m, 1e3 * (g + m) / steps, 100 * (g + m) / busy, backend.comm_label,
                   1e3 * g / steps, 1e3 * m / steps))
        for line in extra:
            run.say(line)
        run.say("gradsync %s  simd %s  |  %s"
                % (info.get("version", getattr(gs, "__version__", "?")),
                   info.get("simd_level", info.get("simd", "?")), mpi_library_line(info)))
        if failures:
            run.say("weights differed at checks after steps: %s" % failures)
        if problem:
            run.say("weight check problem: %s" % problem)
        run.say("weights identical on all %d ranks: %s  (sha256 %s)"
                % (size, "yes" if identical else "NO", digests[0].hex()[:16]))
        if not identical:
            for r, d in enumerate(digests):
                run.say("  rank %d: %s" % (r, d.hex()[:16]))
        if not loss_ok:
            run.say("FAILED: held-out loss did not fall below %g x its initial value"
                    % args.min_loss_ratio)
    return 0 if (identical and loss_ok and not failures) else 1
