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

How it works (docs/DECISIONS.md, "DistributedOptimizer", has the reasons):

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

``op="adasum"`` follows the Adasum paper: the gradients are accumulated
locally (no communication during backward), each rank steps the wrapped
optimizer on its own gradient, the change of every parameter (new - old, in
float32) is combined over the ranks with ONE fused
``comm.allreduce_(deltas, op="adasum")`` (per tensor, DESIGN section 4), and
every rank sets ``params = old + combined delta``.
"""
import contextlib
import logging
import math
import pickle
import threading
import warnings

import numpy as np
import torch

import gradsync as gs
from gradsync.communicator import default_communicator

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters"]

log = logging.getLogger("gradsync.torch")

_OPS = ("average", "sum", "adasum")
_COMPRESSION = {None: None, "none": None,
                "fp16": torch.float16, "float16": torch.float16, torch.float16: torch.float16,
                "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                torch.bfloat16: torch.bfloat16}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# dtypes the C runtime takes as they are; anything else is broadcast as bytes
_WIRE_DTYPES = _FLOAT_DTYPES + (torch.int8, torch.uint8, torch.int32, torch.int64)


def _comm_or_default(comm):
    """``comm``, else the gs.Communicator over COMM_WORLD that gradsync's
    adapters share (created, collectively, on first use)."""
    return default_communicator(comm)


# ------------------------------------------------------------- async requests

class _DoneRequest:
    """What ``_allreduce_async`` returns when the runtime has no asynchronous
    collectives: the blocking call has already run."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors

    def test(self):
        return True

    @property
    def done(self):
        return True


def _has_async(comm):
    f = getattr(comm, "allreduce_async_", None)
    if f is None:
        return False
    handle = getattr(comm, "handle", None)
    return handle is None or hasattr(handle, "allreduce_async")


def _allreduce_async(comm, tensors, op, postscale=1.0, prescale=1.0):
    if _has_async(comm):
        return comm.allreduce_async_(tensors, op=op, prescale=prescale, postscale=postscale)
    comm.allreduce_(tensors, op=op, prescale=prescale, postscale=postscale)
    return _DoneRequest(tensors)


# ------------------------------------------------------------------- buckets

class _Slot:
    """One parameter: its accumulator view and its count of gradients
    received since the last synchronize()."""

    __slots__ = ("index", "name", "param", "bucket", "view", "grad", "count", "inplace")

    def __init__(self, index, name, param):
        self.index, self.name, self.param = index, name, param
        self.bucket = self.view = self.grad = None
        self.count = 0
        # p.grad may be the accumulator itself (backward then adds into it):
        # when the accumulator has the parameter's dtype (float32, float64)
        self.inplace = _acc_dtype(param) == param.dtype


class _Bucket:
    __slots__ = ("index", "slots", "buffer", "wire", "remaining", "request")

    def __init__(self, index, slots):
        self.index, self.slots = index, slots
        self.buffer = self.wire = self.request = None
        self.remaining = len(slots)


def _acc_dtype(p):
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _plan_buckets(slots, bucket_bytes):
    """Buckets over ``slots`` in reverse parameter order, each at most
    ``bucket_bytes`` of accumulator (a parameter larger than that gets a
    bucket of its own), a new bucket wherever the device or the
    accumulation dtype changes."""
    buckets, cur, cur_bytes, cur_key = [], [], 0, None
    for s in reversed(slots):
        key = (s.param.device, _acc_dtype(s.param))
        nbytes = s.param.numel() * (8 if key[1] == torch.float64 else 4)
        if cur and (key != cur_key or cur_bytes + nbytes > bucket_bytes):
            buckets.append(_Bucket(len(buckets), cur))
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += nbytes
        cur_key = key
    if cur:
        buckets.append(_Bucket(len(buckets), cur))
    return buckets


def _arenas(groups, dtype_of=_acc_dtype):
    """One flat zeroed allocation per (device, dtype) holding ``groups``
    (lists of slots) back to back, the dtype ``dtype_of(param)``. Returns
    (arenas, [flat slice per group], {slot: view shaped like its parameter})."""
    sizes = {}
    for g in groups:
        key = (g[0].param.device, dtype_of(g[0].param))
        sizes[key] = sizes.get(key, 0) + sum(s.param.numel() for s in g)
    arenas = {k: torch.zeros(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
    offsets = dict.fromkeys(arenas, 0)
    flats, views = [], {}
    for g in groups:
        key = (g[0].param.device, dtype_of(g[0].param))
        start = off = offsets[key]
        for s in g:
            n = s.param.numel()
            views[s] = arenas[key][off:off + n].view(s.param.shape)
            off += n
        offsets[key] = off
        flats.append(arenas[key][start:off])
    return list(arenas.values()), flats, views


# ------------------------------------------------------- DistributedOptimizer

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
                 comm=None, micro_batches="mean", gradient_predivide_factor=1.0):
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
        self.comm = _comm_or_default(comm)
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
        self._delta = None        # adasum: (arenas, old views, delta views)
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
                if p.dtype not in _FLOAT_DTYPES:
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
        self._slots = [_Slot(i, n, p) for i, (n, p) in enumerate(self._ordered_params())]
        self._buckets = _plan_buckets(self._slots, self.bucket_bytes)
        self._arenas, flats, views = _arenas([b.slots for b in self._buckets])
        for b, flat in zip(self._buckets, flats):
            b.buffer = flat
            if self.compression is not None:
                b.wire = torch.empty(flat.numel(), dtype=self.compression, device=flat.device)
            for s in b.slots:
                s.bucket, s.view = b, views[s]
        # what synchronize() hands out as p.grad: views of one persistent
        # buffer per (device, dtype), in bucket order (no allocation per step)
        copied = [[s] for b in self._buckets for s in b.slots if not s.inplace]
        _, _, grads = _arenas(copied, lambda p: p.dtype)
        for s in self._slots:
            s.grad = grads.get(s)
        self._delta = None
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
            if slot.count == self.backward_passes_per_step and self.op != "adasum":
                b = slot.bucket
                b.remaining -= 1
                if b.remaining == 0:
                    self._start_ready()

    def _start_ready(self):
        """Starts the buckets that are full, in order, up to the first that
        is not."""
        while self._next < len(self._buckets) and self._buckets[self._next].remaining == 0:
            self._start(self._buckets[self._next])
            self._next += 1

    def _micro_scale(self):
        """What the sum over the micro-batches is multiplied by."""
        k = self.backward_passes_per_step
        return 1.0 / k if self.micro_batches == "mean" else 1.0

    def _start(self, b):
        micro = self._micro_scale()
        if self.comm.size == 1:
            # nothing to communicate (compression neither): the mean over
            # the micro-batches is all there is to do
            if micro != 1.0:
                gs.scale_(b.buffer, micro)
            b.request = _DoneRequest(b.buffer)
            return
        if b.wire is None:
            # average: the C op divides by size; postscale 1/k averages the
            # micro-batches in the same multiply
            f = self.gradient_predivide_factor
            b.request = _allreduce_async(self.comm, b.buffer, self.op, postscale=micro * f,
                                         prescale=1.0 / f)
            return
        # the whole average happens before the cast: predividing adds nothing
        factor = micro / (self.comm.size if self.op == "average" else 1)
        if factor != 1.0:
            gs.scale_(b.buffer, factor)
        gs.accumulate_v2_(b.wire, b.buffer, overwrite=True)
        b.request = _allreduce_async(self.comm, b.wire, "sum")

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
        import time
        t0 = time.perf_counter()
        with self._lock:
            if self._synced:
                return
            if self.op == "adasum":
                finite = self._synchronize_local()
            else:
                finite = self._synchronize_reduce()
            grads = self._write_grads()
            if self.op == "adasum" and not finite:
                # one rank's overflow must look the same everywhere (a
                # GradScaler then backs off on every rank alike)
                for g in grads:
                    g.fill_(math.nan)
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

    def _synchronize_reduce(self):
        self._zero_missing()
        for b in self._buckets[self._next:]:
            self._start(b)
        self._next = len(self._buckets)
        for b in self._buckets:
            b.request.wait()
            b.request = None
            if b.wire is not None and self.comm.size > 1:
                gs.accumulate_v2_(b.buffer, b.wire, overwrite=True)
        return gs.all_finite(self._arenas)

    def _synchronize_local(self):
        self._zero_missing()
        micro = self._micro_scale()
        if micro != 1.0:
            gs.scale_(self._arenas, micro)
        bad = np.array([0 if gs.all_finite(self._arenas) else 1], dtype=np.int32)
        self.comm.allreduce_(bad, op="max")
        return not bad[0]

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
        if self.op == "adasum":
            self._adasum_step()
        else:
            self.optimizer.step()
        return loss

    def _adasum_step(self):
        if self._delta is None:
            arenas, _, views = _arenas([[s] for s in self._slots])
            olds = [views[s] for s in self._slots]
            arenas2, _, views2 = _arenas([[s] for s in self._slots])
            self._delta = (arenas, olds, arenas2, [views2[s] for s in self._slots])
        old_arenas, olds, delta_arenas, deltas = self._delta
        params = [s.param.detach() for s in self._slots]
        if not params:
            self.optimizer.step()
            return
        gs.accumulate_v2_(olds, params, overwrite=True)       # old (exact in float32)
        self.optimizer.step()                                  # the local step
        gs.accumulate_v2_(deltas, params, overwrite=True)      # new
        for d, o in zip(delta_arenas, old_arenas):
            d.sub_(o)                                          # delta = new - old
        self.comm.allreduce_(deltas, op="adasum")              # one fused call
        if gs.all_finite(delta_arenas):
            for o, d in zip(old_arenas, delta_arenas):
                o.add_(d)                                      # old + delta, one rounding
        else:
            self.skipped_steps += 1
            if self.comm.rank == 0:
                log.warning("gradsync: Adasum of the parameter changes is not finite; "
                            "parameters restored on every rank (the wrapped optimizer's "
                            "state has advanced)")
        gs.accumulate_v2_(params, olds, overwrite=True)       # cast once into p's dtype


# ---------------------------------------------------------------- broadcasts

def _bcast_object(comm, obj, root):
    """A picklable object from ``root``, as bytes through gradsync (a length,
    then the bytes): not mpi4py's bcast, because gradsync's background
    thread may be inside MPI (MPI_THREAD_SERIALIZED allows one thread at a
    time), and a gradsync call waits for it; any gradsync communicator works
    too, split ones included."""
    data = pickle.dumps(obj) if comm.rank == root else b""
    n = np.array([len(data)], dtype=np.int64)
    comm.broadcast_(n, root=root)
    buf = (np.frombuffer(data, dtype=np.uint8).copy() if comm.rank == root
           else np.empty(int(n[0]), dtype=np.uint8))
    if buf.size:
        comm.broadcast_(buf, root=root)
    return pickle.loads(buf.tobytes())


def _broadcast_tensors(comm, tensors, root):
    """Fused in-place broadcast: one call per device type (in order of first
    appearance), aliases of one memory sent once, non-contiguous tensors
    through a contiguous copy, dtypes the runtime lacks as bytes."""
    groups, seen = {}, set()
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        if t.is_contiguous():
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
        groups.setdefault(t.device.type, []).append(t)
    for ts in groups.values():
        wire, back = [], []
        for t in ts:
            if not t.is_contiguous():
                c = t.contiguous()
                back.append((t, c))
                t = c
            t = t.reshape(-1)
            if t.dtype not in _WIRE_DTYPES:
                t = t.view(torch.uint8)
            wire.append(t)
        comm.broadcast_(wire, root=root)
        for dst, src in back:
            dst.copy_(src)


def _tensors_of(params):
    if isinstance(params, torch.nn.Module):
        return list(params.state_dict().values())
    if isinstance(params, dict):
        items = list(params.values())
    else:
        items = list(params)
    out = []
    for i, it in enumerate(items):
        if isinstance(it, tuple) and len(it) == 2:
            it = it[1]
        if not isinstance(it, torch.Tensor):
            raise TypeError(f"broadcast_parameters: item {i} is {type(it).__name__}, "
                            "not a torch.Tensor")
        out.append(it)
    return out


def broadcast_parameters(params, root=0, comm=None):
    """Every rank's tensors take ``root``'s values, in place, in one fused
    broadcast (per device type). ``params``: a module (its state_dict:
    parameters and buffers), a state_dict, ``named_parameters()`` pairs or a
    list of tensors. Collective."""
    comm = _comm_or_default(comm)
    _broadcast_tensors(comm, _tensors_of(params), root)


class _TensorSpec:
    __slots__ = ("shape", "dtype")

    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _skeleton(obj):
    if isinstance(obj, torch.Tensor):
        return _TensorSpec(obj)
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def _fill(obj):
    if isinstance(obj, _TensorSpec):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: _fill(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root=0, comm=None):
    """Every rank's optimizer takes ``root``'s state (momentum buffers, Adam
    moments, step counts) and hyperparameters (lr, betas, ...), including
    ranks whose optimizer has no state yet. The structure and the non-tensor
    entries (hyperparameters, Python-number step counts) travel pickled from
    root; the tensors in one fused gradsync broadcast. Collective."""
    comm = _comm_or_default(comm)
    opt = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    skeleton = _bcast_object(comm, _skeleton(opt.state_dict()) if comm.rank == root
                             else None, root)
    if comm.rank != root:
        # root's structure and scalars; the tensors are placeholders that
        # load_state_dict places and casts like the parameters
        opt.load_state_dict(_fill(skeleton))
    tensors = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            for k in sorted(st, key=str):
                if isinstance(st[k], torch.Tensor):
                    tensors.append(st[k])
    _broadcast_tensors(comm, tensors, root)
