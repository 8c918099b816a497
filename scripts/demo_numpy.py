"""The NumPy backend of the demo (``--backend numpy``, or when torch does not
import): the MLP of demo_model.py, its gradients averaged by ONE fused call
per step, ``comm.allreduce_(grads, op="average")``, then SGD with momentum,
identical on every rank."""
import time

import demo_model as dm
import numpy as np
from demo_train import N_CLASSES, N_IN, fmt_bytes, fmt_rate

import gradsync as gs


class NumpyMLP:
    title = "data-parallel NumPy MLP training"
    comm_label = "gradient allreduce"

    def __init__(self, comm, args):
        self.comm = comm
        # a DIFFERENT draw on every rank on purpose: replicate() makes them rank 0's
        self.params = dm.init_params(np.random.default_rng([args.seed, 1, comm.rank]), N_IN,
                                     args.hidden, N_CLASSES)
        n = sum(p.size for p in self.params)
        if args.contiguous_grads:
            flat = np.empty(n, dtype=dm.DTYPE)
            self.grads, off = [], 0
            for p in self.params:
                self.grads.append(flat[off:off + p.size].reshape(p.shape))
                off += p.size
        else:
            self.grads = [np.empty_like(p) for p in self.params]
        self.grad_bytes = sum(g.nbytes for g in self.grads)
        self.grad_times = []
        self.contiguous, self.hidden = args.contiguous_grads, args.hidden
        self.opt = dm.SGDMomentum(self.params, args.lr, args.momentum)
        self.wire = args.wire
        self.feedback = gs.ErrorFeedback() if args.wire else None

    def lines(self):
        n = sum(p.size for p in self.params)
        return ["%d -> %d -> %d -> %d (ReLU, softmax), %s parameters in %d arrays, float32"
                % (N_IN, self.hidden, self.hidden, N_CLASSES, format(n, ","), len(self.params)),
                "one fused allreduce_(grads, op=\"average\") per micro-batch: %s in %d "
                "tensors%s; fusion threshold %s"
                % (fmt_bytes(self.grad_bytes), len(self.grads),
                   " (one allocation)" if self.contiguous else "",
                   fmt_bytes(self.comm.fusion_threshold))]

    def replicate(self):
        self.comm.broadcast_(self.params, root=0)
        return "broadcast_(params, root=0)"

    def step(self, batches):
        loss_sum = correct = compute_s = comm_s = 0.0
        for x, y in batches:
            t0 = time.perf_counter()
            loss, right = dm.loss_and_grads(self.params, x, y, self.grads)
            t1 = time.perf_counter()
            self.comm.allreduce_(self.grads, op="average",    # <- the one fused call
                                 wire=self.wire, residual=self.feedback)
            t2 = time.perf_counter()
            self.opt.step(self.params, self.grads)
            compute_s += (t1 - t0) + (time.perf_counter() - t2)
            comm_s += t2 - t1
            self.grad_times.append(t2 - t1)
            loss_sum, correct = loss_sum + loss, correct + right
        return loss_sum, correct, compute_s, comm_s

    def sums(self, x, y):
        return dm.evaluate(self.params, x, y)

    def weights(self):
        return self.params

    def summary(self, steps, comm_s):
        med = float(np.median(self.grad_times))
        size = self.comm.size
        bus = 2.0 * (size - 1) / size
        return ["gradient allreduce %s/call in 1 fused call of %d tensors; median %.2f ms "
                "-> algbw %s, busbw %s"
                % (fmt_bytes(self.grad_bytes), len(self.grads), 1e3 * med,
                   fmt_rate(self.grad_bytes, med),
                   fmt_rate(self.grad_bytes * bus, med) if size > 1 else "n/a")]

    def close(self):
        pass
