"""The autograd-aware collectives of gradsync.torch: each forward is a
gradsync collective on the tensors (DLPack, no copy) and each backward its
adjoint (all_reduce: the same all-reduce, or identity for AllReduce;
all_gather and reduce_scatter: each other; AllSumReduce: itself)."""
import numpy as np
import torch

from gradsync.partition import AllSumReduce as _NumpyAllSumReduce
from gradsync.torch._dlpack import _allreduce, _answer, _export, _import, _op_name, _tensors

__all__ = ["AllReduce", "AllSumReduce", "all_gather", "all_reduce", "reduce_scatter",
           "zero_volume_tensor"]

# The all-reduce ops that are linear and symmetric: their adjoint is themselves.
_SELF_ADJOINT_OPS = ("sum", "average")


def zero_volume_tensor(dtype=None, device=None, requires_grad=False):
    """A tensor with no elements (shape ``(0,)``): what workers outside a
    partition pass to AllSumReduce."""
    return torch.empty((0,), dtype=dtype, device=device, requires_grad=requires_grad)


# ------------------------------------------------------------------ all-reduce

class _SumForwardIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, *xs):
        return _allreduce(comm, xs, "sum")

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + grads


class AllReduce(torch.nn.Module):
    """Sum over the ranks of ``comm`` in forward, identity in backward.

    For outputs that feed computation replicated on every rank, as after a
    row-parallel linear layer in tensor parallelism (Megatron's
    reduce-from-model-parallel region): every rank then receives the same
    output gradient, which is already the gradient of each partial sum.
    Takes a tensor or a list of tensors (one fused message). With one rank
    it returns its input object itself.
    """

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, x):
        if self.comm.size == 1:
            return x
        xs, was_list = _tensors(x, "x")
        if not xs:
            return []
        return _answer(_SumForwardIdentityBackward.apply(self.comm, *xs), was_list)

    def extra_repr(self):
        return f"comm={self.comm!r}"


class _SelfAdjointAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, op, *xs):
        ctx.comm, ctx.op = comm, op
        return _allreduce(comm, xs, op)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + _allreduce(ctx.comm, grads, ctx.op)


def all_reduce(x, comm, op="sum"):
    """A new tensor (or list, fused) holding the reduction over ranks.

    Backward is the same all-reduce: for "sum" and "average" that is the
    exact adjoint. The other ops (min, max, prod, adasum) have no
    self-adjoint backward: they work on tensors that do not require grad (or
    under ``torch.no_grad()``) and raise ValueError otherwise.
    """
    op = _op_name(op)
    xs, was_list = _tensors(x, "x")
    if not xs:
        return []
    if op not in _SELF_ADJOINT_OPS:
        if torch.is_grad_enabled() and any(t.requires_grad for t in xs):
            raise ValueError(f"all_reduce: op={op!r} is not self-adjoint, so it has no "
                             "backward here; use it on tensors that do not require grad "
                             "(or under torch.no_grad())")
        return _answer(_allreduce(comm, xs, op), was_list)
    return _answer(_SelfAdjointAllReduce.apply(comm, op, *xs), was_list)


# ---------------------------------------------------- all-gather / reduce-scatter

def _balanced_rows(n, size):
    return [n // size + (r < n % size) for r in range(size)]


def _reduce_scatter_rows(comm, dy, rows):
    """Sum of ``dy`` over ranks, this rank keeping the ``rows`` rows that it
    contributed to the all-gather. The per-rank row counts are exchanged
    here (a small allgather); when they are the balanced split that
    reduce_scatter uses, it is one reduce_scatter, otherwise an all-reduce
    and a slice."""
    counts = [int(c) for c in comm.allgather(np.array([rows], np.int64))]
    if counts == _balanced_rows(dy.shape[0], comm.size):
        return _import(comm.reduce_scatter(_export(dy), op="sum"))
    start = sum(counts[:comm.rank])
    full = _import(comm.allreduce(_export(dy), op="sum"))
    return full[start:start + rows]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm, ctx.rows = comm, x.shape[0]
        return _import(comm.allgather(_export(x)))

    @staticmethod
    def backward(ctx, dy):
        return None, _reduce_scatter_rows(ctx.comm, dy, ctx.rows)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm = comm
        return _import(comm.reduce_scatter(_export(x), op="sum"))

    @staticmethod
    def backward(ctx, dy):
        return None, _import(ctx.comm.allgather(_export(dy)))


def _check_has_rows(x, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension (dim 0 is split)")


def all_gather(x, comm):
    """Concatenation over ranks along dim 0 (dim 0 may differ by rank).

    Backward: the sum of the output gradients over ranks, each rank keeping
    the rows it contributed, i.e. reduce_scatter. When the ranks' row counts
    are not reduce_scatter's balanced split (``n // size + (r < n % size)``)
    the backward is an all-reduce and a slice instead; either way the
    backward first exchanges the row counts (one small allgather).
    """
    _check_has_rows(x, "all_gather")
    return _AllGather.apply(comm, x)


def reduce_scatter(x, comm):
    """Rank r's block of dim 0 of the sum over ranks: ``n // size +
    (r < n % size)`` rows. Backward: all_gather of the gradient blocks."""
    _check_has_rows(x, "reduce_scatter")
    return _ReduceScatter.apply(comm, x)


# ---------------------------------------------------------------- AllSumReduce

def _all_sum_reduce(layer, tensors):
    if layer.group is None:  # inactive worker, or a group of one: a copy
        return tuple(t.detach().clone() for t in tensors)
    return _allreduce(layer.group, tensors, "sum")


class _AllSumReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, *xs):
        ctx.layer = layer
        return _all_sum_reduce(layer, xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + _all_sum_reduce(ctx.layer, grads)


class AllSumReduce(torch.nn.Module):
    """DistDL's AllSumReduce (docs/GUIDE.md section 2.10) as a self-adjoint module.

    ``AllSumReduce(P_x, axes_reduce=(1,))`` (or ``axes_keep=...``): each
    worker gets the sum over the workers of ``P_x`` that share its index in
    the kept dimensions; the backward is the same sum of the gradients. The
    result is always a new tensor. Inactive workers pass
    ``zero_volume_tensor()`` and get a copy back. Takes a tensor or a list of
    tensors (one fused message).
    """

    def __init__(self, P_x, axes_reduce=None, axes_keep=None):
        super().__init__()
        self.layer = _NumpyAllSumReduce(P_x, axes_reduce=axes_reduce, axes_keep=axes_keep)
        self.P_x = P_x
        self.axes_reduce = self.layer.axes_reduce
        self.axes_keep = self.layer.axes_keep

    def forward(self, x):
        xs, was_list = _tensors(x, "x")
        if not xs:
            return []
        return _answer(_AllSumReduceFunction.apply(self.layer, *xs), was_list)

    def extra_repr(self):
        return f"axes_reduce={self.axes_reduce}, axes_keep={self.axes_keep}"
