"""Timing for every benchmark of the package: the slowest rank's time of a
call, interleaved samples of several candidates, a one-process median; and
gsbench's run context and progress line."""

import statistics
import sys
import time


class Ctx:
    pass


class Progress:
    def __init__(self, enabled):
        self.enabled = enabled
        self.width = 0

    def show(self, text):
        if not self.enabled:
            return
        line = "[gsbench] " + text
        pad = max(0, self.width - len(line))
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()
        self.width = len(line)

    def clear(self):
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def slowest(comm, seconds):
    """The largest of every rank's ``seconds``: how long a collective step took."""
    from mpi4py import MPI  # after gradsync, which may choose MPI's thread level

    return comm.allreduce(seconds, op=MPI.MAX)


def timed(fn, comm, iters=1):
    """Seconds per call of ``fn``: a barrier on ``comm`` (an mpi4py
    communicator), ``iters`` back-to-back calls, the mean per call, the
    slowest rank's."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest(comm, (time.perf_counter() - t0) / iters)


def interleaved(fns, comm, warmup, repeats, iters=1, show=None, sample=timed):
    """Samples of each of ``fns`` (name -> zero-argument callable), interleaved.

    Every callable gets its ``warmup`` calls, then each repeat samples all of
    them in turn (``sample(fn, comm, iters)``, by default ``timed``), so a
    burst of outside load hits every candidate alike. ``show(name, repeat)``,
    if given, is called before each sample. Returns name -> list of samples.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for rep in range(repeats):
        for name, fn in fns.items():
            if show is not None:
                show(name, rep)
            samples[name].append(sample(fn, comm, iters))
    return samples


def median_time(fn, repeats, warmup=1):
    """The median over ``repeats`` calls of ``fn`` of its seconds, in this
    process alone (no MPI), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(ctx, fns, label):
    """gsbench's measurement: ``interleaved`` with the run's warmup, repeats
    and iterations and the progress line. Returns name -> (median over
    repeats in seconds, list of samples)."""

    def show(name, rep):
        ctx.progress.show("%s %s repeat %d/%d" % (label, name, rep + 1, ctx.repeats))

    samples = interleaved(fns, ctx.mpicomm, ctx.warmup, ctx.repeats, ctx.iters, show)
    return {name: (statistics.median(v), v) for name, v in samples.items()}
