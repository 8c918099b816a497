"""DistributedOptimizer with op="sum" or "average": each bucket's allreduce
starts, asynchronously, as soon as backward has filled it; synchronize()
waits for them and hands the reduced gradients out; step() steps the wrapped
optimizer on them."""
import gradsync as gs
from gradsync.torch.buckets import DoneRequest


class AllreduceStep:
    """The reduction of an op="sum"/"average" DistributedOptimizer."""

    reduces_in_backward = True  # buckets start as the gradient hooks fill them

    def __init__(self, opt):
        self.opt = opt

    def start(self, b):
        """Starts bucket ``b``'s reduction."""
        opt = self.opt
        micro = opt._micro_scale()
        if opt.comm.size == 1:
            # nothing to communicate (compression neither): the mean over
            # the micro-batches is all there is to do
            if micro != 1.0:
                gs.scale_(b.buffer, micro)
            b.request = DoneRequest(b.buffer)
            return
        if opt.wire is not None:
            # a low-precision wire format (float32 sums, one rounding; the
            # residual kept), in the background like the others
            b.request = opt.comm.allreduce_async_(b.buffer, op=opt.op, postscale=micro,
                                                  wire=opt.wire, residual=b.feedback)
            return
        if b.wire is None:
            # average: the C op divides by size; postscale 1/k averages the
            # micro-batches in the same multiply
            f = opt.gradient_predivide_factor
            b.request = opt.comm.allreduce_async_(b.buffer, op=opt.op, prescale=1.0 / f,
                                                  postscale=micro * f)
            return
        # the whole average happens before the cast: predividing adds nothing
        factor = micro / (opt.comm.size if opt.op == "average" else 1)
        if factor != 1.0:
            gs.scale_(b.buffer, factor)
        gs.accumulate_v2_(b.wire, b.buffer, overwrite=True)
        b.request = opt.comm.allreduce_async_(b.wire, op="sum")

    def synchronize(self):
        """Starts the buckets that are not full, waits for every one, writes
        p.grad; returns whether every reduced value is finite."""
        opt = self.opt
        opt._zero_missing()
        for b in opt._buckets[opt._next:]:
            self.start(b)
        opt._next = len(opt._buckets)
        for b in opt._buckets:
            b.request.wait()
            b.request = None
            if b.wire is not None and opt.comm.size > 1:
                gs.accumulate_v2_(b.buffer, b.wire, overwrite=True)
        finite = gs.all_finite(opt._arenas)
        opt._write_grads()
        return finite

    def step(self):
        self.opt.optimizer.step()
