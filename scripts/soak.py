"""Soak test (issue 9, load and memory): `make soak`, not part of `make test`.

    mpiexec -n 4 python scripts/soak.py [--seconds 600] [--small 100000]
                                        [--resnet 1000] [--rss-bound-mb 32]

Three phases, every result checked (the run fails on the first wrong one):

1. counts: ``--small`` small fused allreduces (a list of four float32
   tensors of 1-37 elements: the payload rides in the validation message),
   then ``--resnet`` ResNet-50 gradient lists (161 float32 tensors, 25.6M
   elements; gradsync.bench.data.load_shapes("resnet50")), every tenth one
   with op="adasum".
2. mixed, for ``--seconds``: an operation sequence drawn from one seed shared
   by all ranks -- allreduce (sum, average, min, max, prod, adasum; in place,
   out of place, asynchronous; prescale/postscale), broadcast from random
   roots, allgather with per-rank row counts, reduce_scatter, the shard
   collectives (sync and async), the gradient kernels (zero_, accumulate_,
   scale_, all_finite), barriers, and communicators created with a random
   fusion threshold, used and closed -- on lists of random dtypes and sizes
   (0 to 2**20 elements, log-uniform).
3. memory: resident set size (VmRSS) after the warm-up (every kind of call at
   the largest size, in 8-byte dtypes and the longest lists, three times; every
   kind at random sizes twice; two ResNet-50 lists), sampled during the
   mixed phase (about 20 readings, at the same step on every rank), and at
   the end; the run fails if the end is more than ``--rss-bound-mb`` above
   the warm-up figure on any rank, or if on any rank the least-squares
   slope of RSS over the operation count in the second half of the mixed
   phase (the first half settles the heap and buffers) is above
   ``--slope-bound`` bytes per operation by more than twice its standard
   error (a steady leak too small to reach the bound in one run, which a
   job of days would still hit: issue 34). The slope is printed in bytes
   per operation and in MB per hour at the run's rate. Each reading follows
   a full garbage collection and a heap trim (live memory, not what the
   allocators hold for reuse).

Inputs are built so that every rank knows the exact answer without
communicating: rank r holds ``v + r`` (v small integers drawn from the shared
seed), so sums, minima and maxima are exact in every dtype; products use
values in {1, 2} (or {-1, 1, 2}); Adasum gets the same tensor on every rank
(the result is that tensor). Prints one summary line per phase and exits
non-zero on a wrong result or memory growth.
"""
import argparse
import gc
import os
import sys
import time

import ml_dtypes
import numpy as np

import gradsync as gs
from bench.memory import rss_mb
from gradsync import MPI

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
INTS = [np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64)]


def say(*a):
    if ME == 0:
        print(*a, flush=True)


class Wrong(Exception):
    pass


def expect(ok, what):
    if not ok:
        raise Wrong(what)


def equal(got, want, what, rtol=0.0):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Wrong("%s: %s %s, expected %s %s" % (what, got.dtype, got.shape,
                                                    want.dtype, want.shape))
    if rtol == 0.0:
        g = got.view(np.uint8) if got.dtype.kind == "f" or got.dtype == BF16 else got
        w = want.view(np.uint8) if got.dtype.kind == "f" or got.dtype == BF16 else want
        if not np.array_equal(g, w):
            bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:3]
            raise Wrong("%s: %d elements differ, e.g. at %s: %s vs %s" % (
                what, int(np.count_nonzero(got != want)), bad,
                got.reshape(-1)[bad], want.reshape(-1)[bad]))
        return
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    if not np.all(np.abs(g - w) <= rtol * (np.abs(w) + 1e-30)):
        raise Wrong("%s: off by more than %g relative" % (what, rtol))


# ---------------------------------------------------------------- phase 1: counts

def small_allreduces(comm, count):
    sizes = [1, 7, 16, 37]
    base = [np.arange(n, dtype=np.float32) for n in sizes]
    t0 = time.monotonic()
    for k in range(count):
        xs = [b + (ME + k % 5) for b in base]
        comm.allreduce_(xs)
        for b, x in zip(base, xs):
            want = b * P + (P * (P - 1) // 2 + P * (k % 5))
            if not np.array_equal(x, want):
                raise Wrong("small allreduce %d: got %s expected %s" % (k, x, want))
    return time.monotonic() - t0


def resnet_lists(comm, count):
    from gradsync.bench.data import load_shapes
    shapes = load_shapes("resnet50")[0]
    numels = [int(np.prod(s)) for s in shapes]
    flat = np.random.default_rng(7).integers(-8, 9, sum(numels)).astype(np.float32)
    bounds = np.cumsum([0] + numels)
    views = [flat[bounds[i]:bounds[i + 1]].reshape(s) for i, s in enumerate(shapes)]
    xs = [np.empty(s, np.float32) for s in shapes]  # separate allocations: packed
    t0 = time.monotonic()
    adasums = 0
    for k in range(count):
        adasum = k % 10 == 9
        for x, v in zip(xs, views):
            x[...] = v if adasum else v + ME
        comm.allreduce_(xs, "adasum" if adasum else "sum")
        got = np.concatenate([x.reshape(-1) for x in xs])
        if adasum:
            adasums += 1
            equal(got, flat, "resnet list %d (adasum of equal tensors)" % k, rtol=1e-6)
        else:
            equal(got, flat * P + P * (P - 1) // 2, "resnet list %d (sum)" % k)
    return time.monotonic() - t0, adasums


# ---------------------------------------------------------------- phase 2: mixed

class Mixed:
    """One operation per step, drawn from the shared RNG; the same sequence
    on every rank."""

    KINDS = ["allreduce", "allreduce", "allreduce", "allreduce_async", "broadcast",
             "allgather", "reduce_scatter", "shards", "shards_async", "kernels",
             "barrier", "new_comm"]

    def __init__(self, seed, max_log2):
        self.rng = np.random.default_rng(seed)
        self.max_log2 = max_log2
        self.largest = False  # the warm-up's first rounds: see main()
        self.counts = {}
        self.comms = {None: gs.Communicator(WORLD), 4096: gs.Communicator(
            WORLD, fusion_threshold=4096)}

    def close(self):
        for c in self.comms.values():
            c.close()

    def size(self, big=False):
        if self.largest:
            return 2 ** self.max_log2 - 1
        hi = self.max_log2 if big or self.rng.random() < 0.2 else min(12, self.max_log2)
        return int(2 ** self.rng.uniform(0, hi)) - 1  # 0 .. 2**hi - 1

    def dtype(self, floats=False):
        pool = FLOATS if floats else FLOATS + INTS
        if self.largest:  # the widest: the most bytes for a size
            pool = [d for d in pool if d.itemsize == 8]
        return pool[int(self.rng.integers(len(pool)))]

    def upto(self, lo, hi):
        """A list length or row count in lo .. hi - 1: the longest while
        warming up at the largest sizes."""
        return hi - 1 if self.largest else int(self.rng.integers(lo, hi))

    def v(self, n, dt, kind="sum"):
        """Shared small-integer values: exact in every dtype, sums of P
        ranks included."""
        if kind == "prod":
            choices = [1, 2] if dt == np.uint8 else [-1, 1, 2]
            return self.rng.choice(np.array(choices), n).astype(dt)
        lo, hi = (0, 20) if dt == np.uint8 else (-20, 20)
        return self.rng.integers(lo, hi + 1, n).astype(dt)

    def comm(self):
        return self.comms[None if self.rng.random() < 0.6 else 4096]

    def step(self, forced=None, big=False):
        kind = forced or self.KINDS[int(self.rng.integers(len(self.KINDS)))]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        getattr(self, "do_" + kind)(big)

    # -- the operations
    def do_allreduce(self, big, asynchronous=False):
        c = self.comm()
        op = ["sum", "average", "min", "max", "prod", "adasum"][int(self.rng.integers(6))]
        n = self.upto(1, 9)
        dts = [self.dtype(floats=op in ("average", "adasum")) for _ in range(n)]
        vs = [self.v(self.size(big), dt, "prod" if op == "prod" else "sum") for dt in dts]
        pre = post = 1.0
        if op in ("sum", "average", "adasum") and all(d in FLOATS for d in dts):
            pre = [1.0, 0.5, 2.0][int(self.rng.integers(3))]
            post = [1.0, 0.25, 4.0][int(self.rng.integers(3))]
        mode = "async" if asynchronous else ["in", "out"][int(self.rng.integers(2))]
        if op in ("prod", "adasum"):
            xs = [v.copy() for v in vs]
        else:
            xs = [(v.astype(np.int64) + ME).astype(v.dtype) if v.dtype in INTS else
                  (v.astype(np.float64) + ME).astype(v.dtype) for v in vs]
        kw = dict(prescale=pre, postscale=post)
        if mode == "in":
            c.allreduce_(xs, op, **kw)
            outs = xs
        elif mode == "out":
            outs = c.allreduce(xs, op, **kw)
        else:
            outs = c.allreduce_async_(xs, op, **kw).wait()
        for i, (o, v) in enumerate(zip(outs, vs)):
            w = v.astype(np.float64)
            if op in ("sum", "average"):
                w = w * P + P * (P - 1) // 2
            elif op == "max":
                w = w + (P - 1)
            elif op == "prod":
                w = w ** P
            w = w * pre
            w = w * post / (P if op == "average" else 1)
            rtol = 0.0
            if op == "average" and P & (P - 1):  # 1/3 is not exact
                rtol = float(ml_dtypes.finfo(v.dtype).eps) * 4
            if op == "adasum":
                rtol = float(ml_dtypes.finfo(v.dtype).eps) * 8
            want = w.astype(v.dtype) if rtol == 0.0 else w
            what = "allreduce %s %s list[%d] %s n=%d" % (op, mode, i, v.dtype, v.size)
            if rtol:
                equal(o.astype(np.float64), want, what, rtol)
            else:
                equal(o, want, what)

    def do_allreduce_async(self, big):
        self.do_allreduce(big, asynchronous=True)

    def do_broadcast(self, big):
        c = self.comm()
        root = int(self.rng.integers(P))
        vs = [self.v(self.size(big), self.dtype()) for _ in range(self.upto(1, 6))]
        xs = [(v + (ME == root)).astype(v.dtype) for v in vs]
        if self.rng.random() < 0.5:
            c.broadcast_(xs, root=root)
        else:
            c.broadcast_async_(xs, root=root).wait()
        for v, x in zip(vs, xs):
            equal(x, (v + 1).astype(v.dtype), "broadcast from %d" % root)

    def do_allgather(self, big):
        c = self.comm()
        dt = self.dtype()
        trail = [(), (3,)][int(self.rng.integers(2))]
        rows = [self.upto(0, 2 + self.size(big) // 8) for _ in range(P)]
        x = np.full((rows[ME],) + trail, ME, dt)
        out = c.allgather(x)
        want = np.concatenate([np.full((rows[r],) + trail, r, dt) for r in range(P)])
        equal(out, want, "allgather rows %s" % rows)

    def do_reduce_scatter(self, big):
        c = self.comm()
        dt = self.dtype()
        v = self.v(self.size(big), dt)
        out = c.reduce_scatter((v.astype(np.int64) + ME).astype(dt) if dt in INTS else
                               (v.astype(np.float64) + ME).astype(dt))
        n = v.size
        first = ME * (n // P) + min(ME, n % P)
        blk = v[first:first + n // P + (ME < n % P)]
        equal(out, (blk.astype(np.float64) * P + P * (P - 1) // 2).astype(dt),
              "reduce_scatter n=%d" % n)

    def do_shards(self, big, asynchronous=False):
        c = self.comms[None]
        dt = self.dtype()
        counts = [self.size(big) for _ in range(self.upto(1, 7))]
        try:
            lay = gs.ShardLayout(counts, P)
        except ValueError:  # a tensor crosses a rank boundary: a valid layout instead
            counts = [32] * (2 * P)
            lay = gs.ShardLayout(counts, P)
        owners = [lay.owner(i) for i in range(len(counts))]
        vs = [self.v(n, dt) for n in counts]
        if self.rng.random() < 0.5:
            xs = [(v + (ME == o)).astype(dt) for v, o in zip(vs, owners)]
            (c.allgather_shards_async_(xs).wait() if asynchronous else c.allgather_shards_(xs))
            for v, x in zip(vs, xs):
                equal(x, (v + 1).astype(dt), "allgather_shards")
        else:
            xs = [(v.astype(np.int64) + ME).astype(dt) if dt in INTS else
                  (v.astype(np.float64) + ME).astype(dt) for v in vs]
            before = [x.copy() for x in xs]
            (c.reduce_scatter_shards_async_(xs).wait() if asynchronous
             else c.reduce_scatter_shards_(xs))
            for v, x, b, o in zip(vs, xs, before, owners):
                if o == ME:
                    equal(x, (v.astype(np.float64) * P + P * (P - 1) // 2).astype(dt),
                          "reduce_scatter_shards (owned)")
                else:
                    equal(x, b, "reduce_scatter_shards (not owned: unchanged)")

    def do_shards_async(self, big):
        self.do_shards(big, asynchronous=True)

    def do_kernels(self, big):
        n = self.upto(1, 6)
        accs = [self.v(self.size(big), self.dtype(floats=True)) for _ in range(n)]
        grads = [self.v(a.size, self.dtype(floats=True)) for a in accs]
        want = [(a.astype(np.float64) + g.astype(np.float64)).astype(a.dtype)
                for a, g in zip(accs, grads)]
        gs.accumulate_(accs, grads)
        for a, w in zip(accs, want):
            equal(a, w, "accumulate_")
        gs.scale_(accs, 0.5)
        for a, w in zip(accs, want):
            equal(a, (w.astype(np.float64) * 0.5).astype(w.dtype), "scale_")
        expect(gs.all_finite(accs), "all_finite on finite values")
        if accs[-1].size:
            accs[-1].reshape(-1)[-1] = np.inf
            expect(not gs.all_finite(accs), "all_finite with an inf")
        gs.zero_(accs)
        expect(all(not a.view(np.uint8).any() for a in accs), "zero_")

    def do_barrier(self, big):
        self.comm().barrier()

    def do_new_comm(self, big):
        thr = int(2 ** self.rng.uniform(6, 24))
        with gs.Communicator(WORLD, fusion_threshold=thr) as c:
            vs = [self.v(self.size(big), np.dtype(np.float32)) for _ in range(3)]
            outs = c.allreduce([v + ME for v in vs])
            for v, o in zip(vs, outs):
                equal(o, (v * P + P * (P - 1) // 2).astype(np.float32), "new comm allreduce")
            sub = c.split(ME % 2)
            try:
                x = np.ones(5, np.int32)
                sub.allreduce_(x)
                expect(np.all(x == sub.size), "split allreduce")
            finally:
                sub.close()


def rss_reading():
    """RSS in MB as the memory check reads it: after a full garbage
    collection (which also empties CPython's free lists of tuples, floats,
    dicts ...: memory kept for reuse up to fixed counts, and cycles the
    collector's thresholds let wait), then rss_mb's heap trim. Both are
    bounded by design; without them a reading includes how far they have
    filled, which creeps up over the first minutes of random sizes."""
    gc.collect()
    return rss_mb()


def rss_slope(samples):
    """Least-squares slope of RSS over the operation count, in bytes per
    operation, and its standard error: (0, 0) with fewer than 3 samples."""
    if len(samples) < 3:
        return 0.0, 0.0
    x = np.array([s for s, _ in samples], dtype=np.float64)
    y = np.array([m for _, m in samples], dtype=np.float64) * 1048576.0
    x -= x.mean()
    b = float((x * (y - y.mean())).sum() / (x * x).sum())
    resid = y - y.mean() - b * x
    err = float(np.sqrt((resid * resid).sum() / (len(x) - 2) / (x * x).sum()))
    return b, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("SOAK_SECONDS", 600)))
    ap.add_argument("--small", type=int, default=100000, help="small fused allreduces")
    ap.add_argument("--resnet", type=int, default=1000, help="ResNet-50 lists")
    ap.add_argument("--max-log2", type=int, default=20, help="largest tensor: 2**N elements")
    ap.add_argument("--rss-bound-mb", type=float, default=32.0)
    ap.add_argument("--slope-bound", type=float, default=16.0,
                    help="bytes per mixed operation the RSS fit may grow by")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    seed = WORLD.bcast(args.seed if args.seed is not None else int(time.time()), root=0)
    say("soak: %d ranks, seed %d, mixed phase %.0f s, %d small allreduces, %d ResNet-50 "
        "lists, tensors up to 2**%d elements; gradsync %s, %s" % (
            P, seed, args.seconds, args.small, args.resnet, args.max_log2,
            gs.__version__, gs.build_info()["mpi_library"]))
    failed = None
    mixed = Mixed(seed, args.max_log2)
    figures = {}
    try:
        # warm-up: every kind of call at the largest size (2**max_log2 - 1
        # elements, 8-byte dtypes, the longest lists), three times for the
        # random op, mode and dtype choices, so that every buffer a
        # communicator keeps (fusion, bounce, Adasum scratch; they grow to the
        # largest call and are kept) has reached its final size and has had
        # its pages touched before the first RSS sample. A long job's steady
        # state has seen its largest calls; before this (issue 34) the
        # warm-up drew log-uniform sizes, the buffers went on growing through
        # the mixed phase as larger calls came, and the slope read that as
        # +309 B/op. Then every kind at random sizes, twice.
        mixed.largest = True
        for _ in range(3):
            for kind in Mixed.KINDS:
                mixed.step(kind)
        mixed.largest = False
        for _ in range(2):
            for kind in Mixed.KINDS:
                mixed.step(kind, big=True)
        small_allreduces(mixed.comms[None], 100)
        if args.resnet:
            resnet_lists(mixed.comms[None], 2)
        WORLD.Barrier()
        rss_warm = rss_reading()
        figures["rss_warm"] = rss_warm

        t = small_allreduces(mixed.comms[None], args.small)
        say("phase 1: %d small fused allreduces in %.1f s (%.1f us each), 0 wrong; "
            "RSS %.1f MB" % (args.small, t, 1e6 * t / max(args.small, 1), rss_mb()))
        if args.resnet:
            t, adasums = resnet_lists(mixed.comms[None], args.resnet)
            say("phase 1: %d ResNet-50 lists (161 tensors, 25.6M float32; %d of them Adasum) "
                "in %.1f s (%.3f s each), 0 wrong; RSS %.1f MB" % (
                    args.resnet, adasums, t, t / args.resnet, rss_mb()))
        WORLD.Barrier()
        rss_after_counts = rss_reading()

        t0 = time.monotonic()
        steps, samples, last_sample = 0, [], t0
        while True:
            mixed.step()
            steps += 1
            if steps % 25 == 0:
                # rank 0's clock decides for everyone (no request is pending
                # here), so every rank reads its RSS after the same step
                now = time.monotonic()
                sample = now - last_sample >= max(args.seconds / 20, 0.5)
                sample, stop = WORLD.bcast((sample, now - t0 >= args.seconds), root=0)
                if sample:
                    samples.append((steps, rss_reading()))
                    last_sample = now
                if stop:
                    break
        elapsed = time.monotonic() - t0
        WORLD.Barrier()
        rss_end = rss_reading()
        say("phase 2: %d mixed operations in %.0f s, 0 wrong: %s" % (
            steps, elapsed, ", ".join("%s %d" % kv for kv in sorted(mixed.counts.items()))))
        say("phase 2: rank 0 RSS samples (MB): %s" % [round(m, 1) for _, m in samples])
        # judged over the second half: the first settles the heap and the
        # buffers of sizes and dtypes drawn for the first time
        fit, err = rss_slope(samples[len(samples) // 2:])
        whole, _ = rss_slope(samples)
        figures.update(rss_after_counts=rss_after_counts, rss_end=rss_end, slope=fit,
                       slope_err=err, slope_whole=whole,
                       mb_per_hour=fit * steps / elapsed * 3600 / 1e6)
    except Wrong as exc:
        failed = "WRONG RESULT on rank %d: %s" % (ME, exc)
    except Exception as exc:  # noqa: BLE001 - reported with the rank
        failed = "ERROR on rank %d: %s: %s" % (ME, type(exc).__name__, exc)
    if failed:
        # a rank that failed cannot meet the others in the next collective:
        # report and end the job
        print("soak: " + failed, file=sys.stderr, flush=True)
        WORLD.Abort(1)
    mixed.close()
    rows = WORLD.gather(figures, root=0)
    if ME == 0:
        bad, sloped = [], []
        print("phase 3: resident memory per rank (MB): warm-up -> after phase 1 -> end; "
              "slope over phase 2")
        for r, f in enumerate(rows):
            growth = f["rss_end"] - f["rss_warm"]
            print("  rank %d: %.1f -> %.1f -> %.1f (%+.1f); second half %+.1f +- %.1f "
                  "B/operation (%+.2f MB/hour), whole phase %+.1f B/operation" % (
                      r, f["rss_warm"], f["rss_after_counts"], f["rss_end"], growth,
                      f["slope"], f["slope_err"], f["mb_per_hour"], f["slope_whole"]))
            if growth > args.rss_bound_mb:
                bad.append(r)
            if f["slope"] - 2 * f["slope_err"] > args.slope_bound:
                sloped.append(r)
        if bad:
            print("soak: FAILED: resident memory grew by more than %.0f MB on ranks %s"
                  % (args.rss_bound_mb, bad))
        if sloped:
            print("soak: FAILED: resident memory grows by more than %.0f bytes per operation "
                  "over the mixed phase on ranks %s" % (args.slope_bound, sloped))
        if not bad and not sloped:
            print("soak: PASSED: 0 wrong results; memory within %.0f MB of the warm-up figure "
                  "and growing by at most %.0f bytes per operation on every rank"
                  % (args.rss_bound_mb, args.slope_bound))
        code = 1 if bad or sloped else 0
    else:
        code = 0
    code = WORLD.bcast(code, root=0)
    sys.exit(code)


if __name__ == "__main__":
    main()
