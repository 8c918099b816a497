"""Data-parallel training of a PyTorch model: ``DistributedOptimizer``,
``broadcast_parameters`` and ``broadcast_optimizer_state``.

::

    import gradsync as gs
    import gradsync.torch as gst

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = gst.DistributedOptimizer(opt, model.named_parameters(), op="average")
    gst.broadcast_parameters(model.state_dict(), root=0)
    gst.broadcast_optimizer_state(opt, root=0)
    for x, y in shard:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # buckets start reducing during backward
        opt.step()                         # waits for them, then steps

How it works (docs/decisions/torch.md, "DistributedOptimizer", has the reasons):

- The parameters are split into buckets of at most ``bucket_bytes`` (of
  accumulation buffer), in the REVERSE of the parameter order, which is
  roughly the order in which backward produces their gradients. The layout
  is fixed at construction, so the reductions are the same step after step
  (reproducible, bitwise: the C runtime's sums have a fixed order).
- Every bucket is a slice of one flat accumulation buffer in float32
  (float64 for float64 parameters) whatever the parameter dtype. A hook
  registered with ``Tensor.register_post_accumulate_grad_hook`` moves each
  new ``p.grad`` into the parameter's view of that buffer: the step's first
  gradient overwrites it (``gs.accumulate_v2_(..., overwrite=True)``), later
  micro-batches add (``gs.accumulate_``: float32 sum, one rounding). For
  float32 parameters ``p.grad`` then IS that view, so later micro-batches'
  backward adds into the bucket directly (no copy); for float16/bfloat16
  parameters ``p.grad`` is dropped.
- On the last of ``backward_passes_per_step`` micro-batches, once every
  parameter of a bucket has reported, the bucket's asynchronous allreduce
  starts, while backward goes on with the earlier layers. Buckets start in
  bucket order only (a bucket that is ready waits for the ones before it),
  so every rank issues the same collectives in the same order even when the
  ranks' hooks fire in different orders.
- ``synchronize()`` starts the buckets that never filled (parameters that
  got no gradient count as zero), waits for all of them, checks the result
  with ``gs.all_finite`` (the reduced values are identical on every rank,
  so the decision is too) and hands the result out as ``p.grad``: the
  bucket's view itself for float32 parameters, a cast copy in the
  parameter's dtype (one rounding) otherwise. Accumulators are reset by
  overwriting (the next step's first gradient) or by ``gs.zero_`` (params
  without a gradient, ``zero_grad(set_to_none=False)``): never arithmetic.
- Micro-batches are averaged: the gradient of a step is the mean over the
  ``backward_passes_per_step`` micro-batches (and, for op="average", over
  the ranks), so with equal micro-batches it is the gradient of the mean
  loss over the global batch.

``op="adasum"`` steps locally and combines the parameter changes with
Adasum instead (gradsync/torch/adasum_step.py says how).

The pieces: buckets.py (slots, buckets, accumulation buffers),
allreduce_step.py (op="sum"/"average"), adasum_step.py (op="adasum"),
broadcast.py (``broadcast_parameters``, ``broadcast_optimizer_state``,
re-exported here); this module is the optimizer itself.
"""
import contextlib
import logging
import threading
import time
import warnings

import torch

import gradsync as gs
from gradsync.communicator import default_communicator
from gradsync.torch.adasum_step import AdasumStep
from gradsync.torch.allreduce_step import AllreduceStep
from gradsync.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from gradsync.torch.buckets import FLOAT_DTYPES, Slot, arenas, plan_buckets

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters"]

log = logging.getLogger("gradsync.torch")

_OPS = ("average", "sum", "adasum")
_COMPRESSION = {None: None, "none": None,
                "fp16": torch.float16, "float16": torch.float16, torch.float16: torch.float16,
                "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                torch.bfloat16: torch.bfloat16}


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that its step uses gradients reduced over the
    ranks of ``comm`` (default: a gs.Communicator over COMM_WORLD).

    ``op``: ``"average"`` (the mean over ranks), ``"sum"`` or ``"adasum"``
    (step locally, combine the parameter changes with Adasum).
    ``backward_passes_per_step``: micro-batches accumulated (in float32) per
    step; the step's gradient is their MEAN (``micro_batches="sum"``: their
    sum, as torch's own accumulation into p.grad and Horovod give). Call
    ``step()`` after each micro-batch (it only steps on every k-th) or once
    after k backward passes: the micro-batches are counted by the gradient
    hooks.
    ``gradient_predivide_factor`` f (op="average"): the gradients are
    multiplied by 1/f before the sum and by f/size after it (Horovod's
    split of the average, which keeps large sums in range).
    ``bucket_bytes``: the most accumulator bytes reduced in one message.
    ``compression``: None, ``"fp16"`` or ``"bf16"``: each bucket travels in
    that dtype (scaled first, so averaging happens before the cast; the sum
    over ranks accumulates in float32 and rounds once per step) and is cast
    back to float32 after. Not with op="adasum".
    ``wire``: None or a wire format (``"bfloat16"``, ``"float16"``,
    ``"float8_e4m3"``, ``"float8_e5m2"``): each bucket goes on the wire in it
    with float32 sums and one rounding (docs/GUIDE.md section 2.15), with
    error feedback per bucket unless ``error_feedback=False``. The call is
    blocking (host float32 buckets), so it does not overlap backward.
    ``named_parameters``: ``model.named_parameters()``; it fixes the
    parameter order (hence the buckets) and names parameters in errors.
    Without it the order is that of the optimizer's param_groups.

    The object behaves like the wrapped optimizer (param_groups, state,
    defaults, zero_grad, state_dict, load_state_dict, add_param_group, and
    isinstance(..., torch.optim.Optimizer) for LR schedulers). Extra:
    ``synchronize()``, ``skip_synchronize()``, ``skipped_steps`` (steps not
    taken because the reduced gradients were not finite),
    ``sync_seconds`` (time spent in synchronize, cumulative),
    ``bucket_names()``. Every method that communicates is collective: every
    rank calls it, in the same order.

    With a GradScaler (Horovod's pattern)::

        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    Call ``zero_grad()`` (or set the gradients to None) between steps, as
    with any optimizer: a gradient left in ``p.grad`` from the last step
    would be added to the next one. Between backward and synchronize()
    ``p.grad`` is the bucket's running sum (float32 parameters; don't modify
    it) or None; after synchronize() it is the reduced gradient, a view of a
    buffer that the optimizer keeps and reuses every step (copy it to keep
    it). ``zero_grad(set_to_none=False)`` zeroes those views, and backward
    then adds straight into the buckets with no copy at all.
    """

    def __init__(self, optimizer, named_parameters=None, op="average",
                 backward_passes_per_step=1, bucket_bytes=25 * 2**20, compression=None,
                 comm=None, micro_batches="mean", gradient_predivide_factor=1.0,
                 wire=None, error_feedback=True):
        # torch.optim.Optimizer.__init__ is not called: the state lives in
        # the wrapped optimizer, reached through the properties below.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        op = op.lower() if isinstance(op, str) else op
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, got {op!r}")
        k = int(backward_passes_per_step)
        if k != backward_passes_per_step or k < 1:
            raise ValueError("backward_passes_per_step must be a positive integer, got "
                             f"{backward_passes_per_step!r}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
        key = compression.lower() if isinstance(compression, str) else compression
        if key not in _COMPRESSION:
            raise ValueError("compression must be None, 'fp16' or 'bf16', got "
                             f"{compression!r}")
        if op == "adasum" and _COMPRESSION[key] is not None:
            raise ValueError("compression applies to gradient allreduce; op='adasum' "
                             "combines the float32 parameter changes uncompressed")
        if wire is not None and wire not in gs.WIRES:
            raise ValueError(f"wire must be one of {', '.join(gs.WIRES)} or None, got {wire!r}")
        if wire is not None and (op == "adasum" or _COMPRESSION[key] is not None):
            raise ValueError("wire applies to op='sum'/'average' without compression (wire "
                             f"already sends fewer bytes); got op={op!r}, "
                             f"compression={compression!r}")
        if micro_batches not in ("mean", "sum"):
            raise ValueError(f"micro_batches must be 'mean' or 'sum', got {micro_batches!r}")
        predivide = float(gradient_predivide_factor)
        if not predivide > 0 or (predivide != 1.0 and op != "average"):
            raise ValueError("gradient_predivide_factor must be positive, and is for "
                             f"op='average' only; got {gradient_predivide_factor!r} with "
                             f"op={op!r}")
        self.optimizer = optimizer
        self.op = op
        self.backward_passes_per_step = k
        self.micro_batches = micro_batches
        self.gradient_predivide_factor = predivide
        self.bucket_bytes = int(bucket_bytes)
        self.compression = _COMPRESSION[key]
        self.wire = wire
        self.error_feedback = bool(error_feedback)
        self.comm = default_communicator(comm)
        self.skipped_steps = 0
        self.sync_seconds = 0.0
        self._names = None if named_parameters is None else self._check_names(named_parameters)
        self._lock = threading.RLock()
        self._hooks = []
        self._skip_sync = False
        self._synced = False      # synchronize() ran; the step has not been taken yet
        self._nonfinite = False   # ... and found NaN/inf: the step is skipped
        self._passes = 0          # micro-batches seen by the hooks since synchronize()
        self._next = 0            # the next bucket to start
        self._mode = None         # AllreduceStep or AdasumStep (set by _build)
        self._build()

    # ---- the wrapped optimizer's face ----------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        """As the wrapped optimizer's, except while micro-batches are being
        accumulated: then it only lets go of the gradients (the buckets keep
        the running sum), whatever ``set_to_none`` says."""
        with self._lock:
            accumulating = self._passes > 0
            self._end_step()
            views = []
            for s in self._slots:
                if s.param.grad is s.view:
                    if accumulating or set_to_none:
                        s.param.grad = None
                    else:
                        views.append(s.view)
            if views:
                gs.zero_(views)   # backward then adds straight into the buckets
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        """Adds a group to the wrapped optimizer and rebuilds the buckets
        (collective: every rank adds the same group, between steps)."""
        with self._lock:
            if self._passes:
                raise RuntimeError("add_param_group: gradients are being accumulated; "
                                   "call it between steps")
            self.optimizer.add_param_group(param_group)
            self._build()

    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def __getattr__(self, name):
        # anything else the wrapped optimizer has (its own helpers, fields)
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self):
        return (f"DistributedOptimizer(op={self.op!r}, backward_passes_per_step="
                f"{self.backward_passes_per_step}, buckets={len(self._buckets)}, "
                f"compression={self.compression}, ranks={self.comm.size})\n"
                f"{self.optimizer!r}")

    # ---- setup -----------------------------------------------------------------
    @staticmethod
    def _check_names(named_parameters):
        pairs = list(named_parameters)
        if any(not (isinstance(t, tuple) and len(t) == 2) for t in pairs):
            raise ValueError("named_parameters must be a sequence of (name, parameter) "
                             "pairs, e.g. model.named_parameters()")
        names = [n for n, _ in pairs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"named_parameters has duplicate names: {dup}")
        return {id(p): (i, n) for i, (n, p) in enumerate(pairs)}

    def _ordered_params(self):
        """The optimizer's parameters that require grad: (name, param) in
        named_parameters order (else param_groups order)."""
        out, seen = [], set()
        for g, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                if p.dtype not in FLOAT_DTYPES:
                    raise TypeError(f"parameter {g}.{j} has dtype {p.dtype}; "
                                    "DistributedOptimizer reduces floating gradients only")
                out.append((f"param_groups[{g}][{j}]", p))
        if self._names is not None:
            missing = [n for n, p in out if id(p) not in self._names]
            if missing:
                raise ValueError(f"{len(missing)} parameter(s) of the optimizer are not in "
                                 f"named_parameters (first: {missing[0]}); pass "
                                 "model.named_parameters() of the model being optimized")
            out = sorted(((self._names[id(p)][1], p) for _, p in out),
                         key=lambda np_: self._names[id(np_[1])][0])
        return out

    def _build(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._slots = [Slot(i, n, p) for i, (n, p) in enumerate(self._ordered_params())]
        self._buckets = plan_buckets(self._slots, self.bucket_bytes)
        self._arenas, flats, views = arenas([b.slots for b in self._buckets])
        for b, flat in zip(self._buckets, flats):
            b.buffer = flat
            if self.compression is not None:
                b.wire = torch.empty(flat.numel(), dtype=self.compression, device=flat.device)
            # a low-precision wire format: the bucket's residual (error feedback)
            b.feedback = gs.ErrorFeedback() if self.wire and self.error_feedback else None
            for s in b.slots:
                s.bucket, s.view = b, views[s]
        # what synchronize() hands out as p.grad: views of one persistent
        # buffer per (device, dtype), in bucket order (no allocation per step)
        copied = [[s] for b in self._buckets for s in b.slots if not s.inplace]
        _, _, grads = arenas(copied, lambda p: p.dtype)
        for s in self._slots:
            s.grad = grads.get(s)
        self._mode = AdasumStep(self) if self.op == "adasum" else AllreduceStep(self)
        self._next = 0
        self._passes = 0
        for s in self._slots:
            self._hooks.append(s.param.register_post_accumulate_grad_hook(
                lambda p, s=s: self._on_grad(s, p)))

    def bucket_names(self):
        """The buckets, in reduction order, as lists of parameter names."""
        return [[s.name for s in b.slots] for b in self._buckets]

    # ---- backward --------------------------------------------------------------
    def _end_step(self):
        """A new step begins: forget the last synchronize() (a GradScaler may
        have skipped the step() that would have)."""
        self._synced = False
        self._nonfinite = False

    def _on_grad(self, slot, p):
        g = p.grad
        if g is None:
            return
        if g.layout != torch.strided:
            raise RuntimeError(f"{slot.name}: DistributedOptimizer does not reduce sparse "
                               "gradients")
        with self._lock:
            if self._synced:
                self._end_step()
            if slot.count >= self.backward_passes_per_step:
                raise RuntimeError(
                    f"{slot.name}: gradients were computed more than "
                    f"backward_passes_per_step={self.backward_passes_per_step} times before "
                    "step()/synchronize(); raise backward_passes_per_step to accumulate more "
                    "micro-batches")
            if g is not slot.view:
                # a gradient autograd allocated: the first of the step
                # overwrites the accumulator (which holds the last step's
                # values or zeros), later ones add (float32, one rounding)
                if not g.is_contiguous():
                    g = g.contiguous()
                if slot.count == 0:
                    gs.accumulate_v2_(slot.view, g, overwrite=True)
                else:
                    gs.accumulate_(slot.view, g)
                # float32 parameters: p.grad becomes the accumulator, so the
                # next micro-batch's backward adds straight into the bucket
                p.grad = slot.view if slot.inplace else None
            # else backward has already added into the accumulator
            slot.count += 1
            if slot.count > self._passes:
                self._passes = slot.count
            if slot.count == self.backward_passes_per_step and self._mode.reduces_in_backward:
                b = slot.bucket
                b.remaining -= 1
                if b.remaining == 0:
                    self._start_ready()

    def _start_ready(self):
        """Starts the buckets that are full, in order, up to the first that
        is not."""
        while self._next < len(self._buckets) and self._buckets[self._next].remaining == 0:
            self._mode.start(self._buckets[self._next])
            self._next += 1

    def _micro_scale(self):
        """What the sum over the micro-batches is multiplied by."""
        k = self.backward_passes_per_step
        return 1.0 / k if self.micro_batches == "mean" else 1.0

    # ---- synchronize -----------------------------------------------------------
    def synchronize(self):
        """Waits for every bucket's reduction (starting those that are not
        full: parameters without a gradient count as zero) and writes the
        result into ``p.grad`` in the parameter's dtype. Collective.

        If any reduced value is NaN or inf, the coming step() is skipped on
        every rank (the gradients are still written, so a GradScaler sees the
        overflow too). For op="adasum" it only moves the locally accumulated
        gradients into ``p.grad``; the ranks agree on finiteness with one
        small allreduce."""
        t0 = time.perf_counter()
        with self._lock:
            if self._synced:
                return
            finite = self._mode.synchronize()
            for s in self._slots:
                s.count = 0
            for b in self._buckets:
                b.remaining = len(b.slots)
            self._next = 0
            self._passes = 0
            self._synced = True
            self._nonfinite = not finite
            if not finite:
                self.skipped_steps += 1
                if self.comm.rank == 0:
                    log.warning("gradsync: non-finite gradients; skipping the step on every "
                                "rank (%d skipped so far)", self.skipped_steps)
        self.sync_seconds += time.perf_counter() - t0

    def _zero_missing(self):
        """Accumulators of parameters that got no gradient this step (they
        still hold the last step's values): zero, by gs.zero_."""
        missing = [s.view for s in self._slots if s.count == 0]
        if missing:
            gs.zero_(missing)
            for s in self._slots:
                if s.count == 0 and s.param.grad is s.view:
                    s.param.grad = None

    def _write_grads(self):
        """p.grad := the reduced gradient: the accumulator itself for float32
        (float64) parameters, else a cast copy (one rounding) into a
        persistent buffer of the parameter's dtype."""
        grads, dst, src = [], [], []
        for s in self._slots:
            g = s.view if s.inplace else s.grad
            if s.param.grad is not g:
                s.param.grad = g
            grads.append(g)
            if not s.inplace:
                dst.append(s.grad)
                src.append(s.view)
        if dst:
            gs.accumulate_v2_(dst, src, overwrite=True)
        return grads

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: for when
        synchronize() was called already (GradScaler.unscale_, gradient
        clipping between synchronize() and the step)."""
        prev = self._skip_sync
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = prev

    # ---- step ------------------------------------------------------------------
    def step(self, closure=None):
        """Synchronizes (unless inside skip_synchronize(), or already done)
        and steps the wrapped optimizer, or skips the step on every rank if
        the reduced gradients are not finite. With backward_passes_per_step
        k > 1 it only steps once k micro-batches have been accumulated;
        earlier calls return without doing anything. ``closure`` is
        evaluated once, before synchronizing (it runs the backward pass);
        optimizers that evaluate the closure several times (LBFGS) are not
        supported."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synced:
            if 0 < self._passes < self.backward_passes_per_step and not self._skip_sync:
                return loss  # still accumulating micro-batches
            if self._skip_sync and self._passes:
                warnings.warn("DistributedOptimizer.step() inside skip_synchronize() "
                              "without synchronize() first: synchronizing now",
                              stacklevel=2)
            self.synchronize()
        skip = self._nonfinite
        self._synced = self._nonfinite = False
        if skip:
            return loss
        self._mode.step()
        return loss
