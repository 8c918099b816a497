"""gsbench timing: the run context, the progress line, interleaved measurement."""

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


def measure(ctx, fns, label):
    """Times each of ``fns`` (name -> zero-argument callable), interleaved.

    Every callable gets its warmup, then each repeat times all of them in turn
    (a barrier, ``iters`` back-to-back calls, the mean per call, the maximum
    over ranks), so a burst of outside load hits every candidate alike.
    Returns name -> (median over repeats in seconds, list of samples).
    """
    MPI = ctx.MPI
    for fn in fns.values():
        for _ in range(ctx.warmup):
            fn()
    samples = {name: [] for name in fns}
    for rep in range(ctx.repeats):
        for name, fn in fns.items():
            ctx.progress.show("%s %s repeat %d/%d" % (label, name, rep + 1, ctx.repeats))
            ctx.mpicomm.Barrier()
            t0 = time.perf_counter()
            for _ in range(ctx.iters):
                fn()
            dt = (time.perf_counter() - t0) / ctx.iters
            samples[name].append(ctx.mpicomm.allreduce(dt, op=MPI.MAX))
    return {name: (statistics.median(v), v) for name, v in samples.items()}
