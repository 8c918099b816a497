"""DLPack plumbing of gradsync.torch: torch tensors into gradsync's calls
and results back, without a copy (CPU or CUDA alike)."""
import numpy as np
import torch

import gradsync as _gs
from gradsync.ops import Op as _Op

_BF16 = np.dtype(_gs.bfloat16)

def _export(t):
    """What gradsync receives for tensor ``t``: the tensor itself (DLPack, no
    copy), detached (torch refuses to export tensors that require grad) and
    C-contiguous (a copy only when it is not). Host bfloat16 goes as an
    ml_dtypes.bfloat16 NumPy view of the same memory, because NumPy's DLPack
    import has no bfloat16."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16 and t.device.type == "cpu":
        return np.from_dlpack(t.view(torch.int16)).view(_BF16)
    return t


def _import(a):
    """A gradsync result as a torch tensor sharing its memory."""
    if isinstance(a, np.ndarray) and a.dtype == _BF16:
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _tensors(x, what):
    """(list of tensors, was_a_sequence)."""
    if isinstance(x, (list, tuple)):
        xs, was_list = list(x), True
    else:
        xs, was_list = [x], False
    for i, t in enumerate(xs):
        if not isinstance(t, torch.Tensor):
            where = f"{what}[{i}]" if was_list else what
            raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    return xs, was_list


def _answer(outs, was_list):
    return list(outs) if was_list else outs[0]


def _op_name(op):
    if isinstance(op, _Op):
        return op.name.lower()
    if isinstance(op, str):
        return op.lower()
    return _Op(int(op)).name.lower()


def _allreduce(comm, tensors, op):
    outs = comm.allreduce([_export(t) for t in tensors], op=op)
    return tuple(_import(o) for o in outs)
