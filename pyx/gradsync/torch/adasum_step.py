"""DistributedOptimizer with op="adasum", as in the Adasum paper: the
gradients are accumulated locally (no communication during backward), each
rank steps the wrapped optimizer on its own gradient, the change of every
parameter (new - old, in float32) is combined over the ranks with ONE fused
``comm.allreduce_(deltas, op="adasum")`` (per tensor: docs/GUIDE.md,
"Adasum"), and every rank sets ``params = old + combined delta``."""
import logging
import math

import numpy as np

import gradsync as gs
from gradsync.torch.buckets import arenas

log = logging.getLogger("gradsync.torch")


class AdasumStep:
    """The local step and the Adasum of the parameter changes."""

    reduces_in_backward = False  # nothing travels until step()

    def __init__(self, opt):
        self.opt = opt
        self._delta = None  # (old arenas, old views, delta arenas, delta views)

    def synchronize(self):
        """Moves the local gradients into p.grad; the ranks agree on whether
        they are finite with one small allreduce (returned)."""
        opt = self.opt
        opt._zero_missing()
        micro = opt._micro_scale()
        if micro != 1.0:
            gs.scale_(opt._arenas, micro)
        bad = np.array([0 if gs.all_finite(opt._arenas) else 1], dtype=np.int32)
        opt.comm.allreduce_(bad, op="max")
        grads = opt._write_grads()
        if bad[0]:
            # one rank's overflow must look the same everywhere (a
            # GradScaler then backs off on every rank alike)
            for g in grads:
                g.fill_(math.nan)
        return not bad[0]

    def step(self):
        opt = self.opt
        slots = opt._slots
        if self._delta is None:
            old_arenas, _, views = arenas([[s] for s in slots])
            delta_arenas, _, views2 = arenas([[s] for s in slots])
            self._delta = (old_arenas, [views[s] for s in slots], delta_arenas,
                           [views2[s] for s in slots])
        old_arenas, olds, delta_arenas, deltas = self._delta
        params = [s.param.detach() for s in slots]
        if not params:
            opt.optimizer.step()
            return
        gs.accumulate_v2_(olds, params, overwrite=True)       # old (exact in float32)
        opt.optimizer.step()                                   # the local step
        gs.accumulate_v2_(deltas, params, overwrite=True)      # new
        for d, o in zip(delta_arenas, old_arenas):
            d.sub_(o)                                          # delta = new - old
        opt.comm.allreduce_(deltas, op="adasum")               # one fused call
        if gs.all_finite(delta_arenas):
            for o, d in zip(old_arenas, delta_arenas):
                o.add_(d)                                      # old + delta, one rounding
        else:
            opt.skipped_steps += 1
            if opt.comm.rank == 0:
                log.warning("gradsync: Adasum of the parameter changes is not finite; "
                            "parameters restored on every rank (the wrapped optimizer's "
                            "state has advanced)")
        gs.accumulate_v2_(params, olds, overwrite=True)       # cast once into p's dtype
