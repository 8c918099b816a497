"""``broadcast_parameters`` and ``broadcast_optimizer_state``: model and
optimizer state from one rank to all, in fused gradsync broadcasts."""
import pickle

import numpy as np
import torch

from gradsync.communicator import default_communicator
from gradsync.torch.buckets import FLOAT_DTYPES

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

# dtypes the C runtime takes as they are; anything else is broadcast as bytes
_WIRE_DTYPES = FLOAT_DTYPES + (torch.int8, torch.uint8, torch.int32, torch.int64)


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
    comm = default_communicator(comm)
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
    comm = default_communicator(comm)
    # a wrapper (DistributedOptimizer, Horovod's) exposes the optimizer it
    # wraps as .optimizer, as torch's LR schedulers expect: its state is that one's
    inner = getattr(optimizer, "optimizer", None)
    opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
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
