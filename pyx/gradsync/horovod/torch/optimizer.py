"""Horovod's DistributedOptimizer: gradsync.torch's DistributedOptimizer
with Horovod's arguments and semantics.

- The returned object is an instance of a class named after the wrapped
  optimizer's, deriving from it (``isinstance(opt, torch.optim.SGD)`` holds,
  as in Horovod), with gradsync's DistributedOptimizer first in line.
- ``backward_passes_per_step=k``: the gradients of the k passes are SUMMED
  (torch's accumulation into p.grad, which Horovod reduces), then averaged
  (op=Average) over ranks; step() always steps, reducing what has been
  accumulated so far (Horovod's synchronize() forces the missing reductions).
- step() after synchronize() without skip_synchronize() warns, as Horovod.
- Buckets (gradsync's fusion) replace Horovod's per-tensor allreduces and
  ``groups``; the sums are elementwise, so grouping never changes a result.
- Reductions go through the process set's engine: a rank that has called
  hvd.join() contributes zeros, as in Horovod.
"""
import math
import warnings

import torch

import gradsync as gs
import gradsync.torch as gst
from gradsync import MPI
from gradsync.horovod import state
from gradsync.horovod.basics import OP_NAMES, Adasum, Average, Sum
from gradsync.horovod.comm import EngineComm
from gradsync.horovod.process_sets import global_process_set
from gradsync.horovod.torch.compression import Compression, FP16Compressor, NoneCompressor

__all__ = ["DistributedOptimizer"]

_BUCKET_BYTES = 25 * 2**20


class _HorovodDistributedOptimizer(gst.DistributedOptimizer):
    """gradsync's DistributedOptimizer with Horovod's step() and names."""

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, process_set, sparse_as_dense=False):
        named = None if named_parameters is None else list(named_parameters)
        if named is None:
            named = [(f"allreduce.noname.{i}.{j}", p)
                     for i, group in enumerate(optimizer.param_groups)
                     for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        self._hvd_process_set = process_set
        self._should_warn = False
        self._sparse_as_dense = bool(sparse_as_dense)
        self._sparse = {}   # slot -> this step's sparse gradient (summed over passes)
        self._densified = set()  # slots whose sparse gradient went dense (sparse_as_dense)
        self._hvd_op = op
        fp16 = compression is FP16Compressor
        # Compression.fp16 goes on gradsync's float16 wire where it can (float32
        # sums, one rounding: docs/GUIDE.md 2.15), else Horovod's cast-then-reduce
        wire = "float16" if fp16 and _wire_takes(named, op) else None
        super().__init__(optimizer, named, op=OP_NAMES[op], micro_batches="sum",
                         backward_passes_per_step=backward_passes_per_step,
                         bucket_bytes=_bucket_bytes(optimizer, groups),
                         compression="fp16" if fp16 and wire is None else None,
                         wire=wire, error_feedback=False,
                         comm=_comm_for(process_set),
                         gradient_predivide_factor=gradient_predivide_factor)
        self._parameter_names = {p: n for n, p in named}

    def _on_grad(self, slot, p):
        """Sparse gradients (nn.Embedding(sparse=True)), as Horovod reduces
        them: with sparse_as_dense they become dense and go into the bucket
        (and sparse again after synchronize(), for the optimizer's step);
        otherwise the bucket reduces zeros for the parameter and
        synchronize() reduces the sparse gradient by allgathering its indices
        and values (hvd.sparse_allreduce_async), p.grad staying sparse."""
        g = p.grad
        if g is not None and g.layout != torch.strided:
            if self._sparse_as_dense:  # made sparse again after the reduction (Horovod's)
                self._densified.add(slot)
                p.grad = g.to_dense()
            else:
                prior = self._sparse.get(slot)
                self._sparse[slot] = g if prior is None else prior + g
                p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        super()._on_grad(slot, p)

    def _reduce_sparse(self):
        from gradsync.horovod.torch.mpi_ops import sparse_allreduce_async

        pending, self._sparse = self._sparse, {}
        if not self._hvd_process_set.included():
            for slot, g in pending.items():
                slot.param.grad = g
            return
        results = [(slot, sparse_allreduce_async(g, name=f"sparse.{slot.name}",
                                                 op=self._hvd_op,
                                                 process_set=self._hvd_process_set))
                   for slot, g in sorted(pending.items(), key=lambda kv: kv[0].name)]
        for slot, result in results:
            slot.param.grad = result()

    def set_backward_passes_per_step(self, passes):
        """Changes the number of backward passes per step (between steps)."""
        if int(passes) != passes or passes < 1:
            raise ValueError(f"backward_passes_per_step must be > 0, got {passes!r}")
        self.backward_passes_per_step = int(passes)

    def synchronize(self):
        """Waits for every gradient's reduction and writes p.grad."""
        super().synchronize()
        if self._sparse:
            self._reduce_sparse()
        densified, self._densified = self._densified, set()
        for slot in densified:
            if slot.param.grad is not None:
                slot.param.grad = slot.param.grad.to_sparse()
        self._should_warn = True

    def step(self, closure=None):
        """Synchronizes (unless inside skip_synchronize()) and steps: always,
        whatever number of backward passes has been accumulated."""
        if self._should_warn and not self._skip_sync:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(). This can cause training "
                          "slowdown. You may want to consider using "
                          "optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.", stacklevel=2)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synced and not self._skip_sync:
            self.synchronize()
        self._should_warn = False
        super().step()
        return loss


def _wire_takes(named, op):
    """Whether Compression.fp16 can take the float16 wire: a summing op and
    float32 parameters only (the wire takes float32; Horovod's fp16 leaves
    other dtypes as they are)."""
    return op in (Average, Sum) and all(p.dtype == torch.float32 for _, p in named)


def _comm_for(process_set):
    """The engine of the set for its members; a one-rank communicator for
    others (their optimizer steps on local gradients, as Horovod's)."""
    state.check_initialized()
    if process_set.included():
        return EngineComm(process_set.engine())

    return gs.Communicator(MPI.COMM_SELF)


def _bucket_bytes(optimizer, groups):
    """``groups=N`` (Horovod's number of fused groups): buckets of about 1/N
    of the gradients; a list of parameter lists only says what may fuse,
    which never changes a result: gradsync's default buckets."""
    if groups is None or isinstance(groups, list):
        return _BUCKET_BYTES
    total = sum(p.numel() * (8 if p.dtype == torch.float64 else 4)
                for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return max(1, math.ceil(total / groups))


def _check_groups(groups):
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    elif not isinstance(groups, int) or groups <= 0:
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps ``optimizer`` so that step() uses gradients reduced over the
    process set (Horovod's arguments; module docstring for the semantics).
    ``compression``: Compression.none or Compression.fp16. ``op``: Average,
    Sum or Adasum. Sparse gradients are reduced as Horovod reduces them:
    their indices and values allgathered, or, with ``sparse_as_dense``, as
    dense gradients made sparse again before the step."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    if compression not in (Compression.none, Compression.fp16, NoneCompressor, FP16Compressor):
        raise ValueError("gradsync.horovod's DistributedOptimizer takes Compression.none or "
                         f"Compression.fp16, not {compression!r}")
    _check_groups(groups)
    cls = type(optimizer.__class__.__name__,
               (_HorovodDistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, process_set, sparse_as_dense)
