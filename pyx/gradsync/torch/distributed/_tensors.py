"""torch tensors as gradsync sees them, for the torch.distributed backend.

gradsync reads tensors through DLPack without a copy (host bfloat16 as an
ml_dtypes view of the same memory). What it cannot take as it is gets a
stand-in, and a ``finish`` step that puts results back after the call:

* non-contiguous tensors: a contiguous copy, copied back when written;
* bool (any op: as uint8 bytes; reductions OR/AND through max/min);
* dtypes gradsync has no arithmetic for (int16, uint16, uint32, uint64, float8,
  complex...): moved as raw bytes; reduced, when torch allows, in a wider
  dtype (int16/uint16 in int32) or as real pairs (complex sum/average).
"""
import numpy as np
import torch
import torch.distributed as dist

from gradsync.torch._dlpack import _export as _gs_view

_NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
           torch.uint8, torch.int32, torch.int64}
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32}
_OPS = {dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "average",
        dist.ReduceOp.RedOpType.MIN: "min", dist.ReduceOp.RedOpType.MAX: "max",
        dist.ReduceOp.RedOpType.PRODUCT: "prod", dist.ReduceOp.RedOpType.PREMUL_SUM: "sum"}
_BOOL_OPS = {"sum": "max", "max": "max", "min": "min", "prod": "min"}


def reduce_op(op, what):
    """(gradsync op name, prescale) for a torch ReduceOp."""
    kind = op.op if hasattr(op, "op") else op
    if kind not in _OPS:
        raise NotImplementedError(f"gradsync backend: {what} with ReduceOp.{kind.name} is not "
                                  "supported (SUM, AVG, PRODUCT, MIN, MAX and PREMUL_SUM are)")
    prescale = 1.0
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = op.factor
        prescale = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return _OPS[kind], prescale


def _check(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gradsync backend: {what} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.is_sparse:
        raise NotImplementedError(f"gradsync backend: {what} is a sparse tensor; sparse "
                                  "collectives are not supported")


def as_bytes(t):
    """A contiguous tensor's memory as a flat uint8 tensor (same memory)."""
    return t.reshape(-1).view(torch.uint8)


class Staged:
    """The objects to hand gradsync for a list of tensors, and how to finish.

    ``views`` are flat (1-D) unless ``keep_shape``; ``finish()`` copies
    results back into tensors that got a stand-in (when ``written``)."""

    def __init__(self, tensors, what, written, op=None, keep_shape=False):
        self.views, self._back = [], []
        self.op = op
        for i, t in enumerate(tensors):
            where = f"{what}[{i}]" if len(tensors) > 1 else what
            _check(t, where)
            self.views.append(self._stage(t, where, written, keep_shape))

    def _stage(self, t, where, written, keep_shape):
        src = t if t.is_contiguous() else t.contiguous()
        shaped = src if keep_shape else src.reshape(-1)
        dt = t.dtype
        if self.op is None:  # data movement: bytes for what gradsync cannot type
            view = shaped if dt in _NATIVE else shaped.view(torch.uint8)
        elif dt == torch.bool:
            self.op = _BOOL_OPS.get(self.op) or self._refuse(where, dt)
            view = shaped.view(torch.uint8)
        elif dt in _NATIVE:
            view = shaped
        elif dt in _WIDER:
            view = shaped.to(_WIDER[dt])  # a copy: finish casts it back
        elif dt.is_complex and self.op in ("sum", "average"):
            view = torch.view_as_real(shaped)
        else:
            view = self._refuse(where, dt)
        if written:  # every stand-in but the widened copy shares src's memory
            widened = self.op is not None and dt in _WIDER
            if widened or src is not t:
                self._back.append((t, view if widened else src))
        return _gs_view(view)

    def _refuse(self, where, dt):
        raise TypeError(f"gradsync backend: {where} has dtype {dt}, which cannot be reduced "
                        f"with op {self.op!r} here")

    def finish(self):
        """Copies results held by stand-ins back (casting where widened)."""
        for t, held in self._back:
            t.copy_(held.reshape(t.shape))


def flat_view(t):
    """A 1-D tensor sharing memory with contiguous ``t`` (its bytes when
    gradsync has no such dtype)."""
    flat = t.reshape(-1)
    return flat if t.dtype in _NATIVE else flat.view(torch.uint8)


def numel_units(t):
    """Elements of ``t`` as flat_view counts them."""
    return t.numel() if t.dtype in _NATIVE else t.numel() * t.element_size()


def export(t):
    """gradsync's view of a contiguous tensor (no copy)."""
    return _gs_view(t)


__all__ = ["Staged", "as_bytes", "export", "flat_view", "numel_units", "reduce_op", "np"]

def unsupported(what):
    raise NotImplementedError(f"gradsync backend: {what} is not supported")


def cat(tensors):
    """One flat contiguous tensor holding the tensors' elements in order."""
    return torch.cat([flat_view(t.contiguous()) for t in tensors]) if tensors else None


def scatter_into(flat, tensors):
    """Copies consecutive pieces of ``flat`` into ``tensors``."""
    offset = 0
    for t in tensors:
        n = numel_units(t)
        piece = flat[offset:offset + n]
        if t.dtype != piece.dtype:
            piece = piece.view(t.dtype)
        t.copy_(piece.reshape(t.shape))
        offset += n


def rows(view, rows):
    """gradsync's flat view reshaped into ``rows`` rows (dim 0 is split)."""
    if isinstance(view, np.ndarray):
        return view.reshape(rows, -1) if view.size else view.reshape(rows, 0)
    return view.reshape(rows, -1) if view.numel() else view.reshape(rows, 0)
