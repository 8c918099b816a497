"""Horovod's broadcast_parameters, broadcast_optimizer_state,
broadcast_object and allgather_object, on gradsync.torch's fused broadcasts."""
import io
import pickle

import torch

import gradsync.torch as gst
from gradsync.horovod import state
from gradsync.horovod.comm import EngineComm
from gradsync.horovod.process_sets import global_process_set
from gradsync.horovod.torch.mpi_ops import allgather, broadcast_

try:
    import cloudpickle as _pickler  # what Horovod uses: lambdas and local classes pickle too
except ImportError:
    _pickler = pickle

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def _world_comm(process_set=global_process_set):
    state.check_initialized()
    return EngineComm(process_set.engine())


def broadcast_parameters(params, root_rank):
    """Every rank's tensors take ``root_rank``'s values, in place: a
    state_dict (parameters and buffers), named_parameters() pairs, or a list
    of tensors (a module and generators work too). One fused broadcast per
    device type instead of Horovod's one per tensor; same result."""
    if isinstance(params, dict):
        params = sorted(params.items())
    gst.broadcast_parameters(params, root=root_rank, comm=_world_comm())


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer) if isinstance(
        optimizer, gst.DistributedOptimizer) else optimizer


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Every rank's optimizer takes root's state (tensors and the non-tensor
    entries such as step counts) and hyperparameters (lr, momentum, ...).

    As in Horovod, a rank whose optimizer has no state yet first creates it
    with one step on zero gradients (Adam's step count becomes 1; with weight
    decay the parameters move); then root's state replaces it everywhere.
    LBFGS is refused, as in Horovod. ``model`` is accepted (Horovod uses it
    for sparse embeddings, which gradsync.horovod does not reduce)."""
    opt = _inner(optimizer)
    if isinstance(opt, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if len(opt.state_dict()["state"]) == 0:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        opt.step()
    gst.broadcast_optimizer_state(opt, root=root_rank, comm=_world_comm())


def _dumps(obj):
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return buf.getvalue()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (pickled) on every rank of the set. ``name``,
    when given, takes part in the check (Horovod's default, the object's
    type name, does not: it differs when other ranks pass None)."""
    me = state.world_rank()
    if me == root_rank:
        data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast_(size, root_rank, None if name is None else name + ".sz", process_set)
    if me != root_rank:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    broadcast_(data, root_rank, None if name is None else name + ".t", process_set)
    if me == root_rank:
        return obj
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64),
                      None if name is None else name + ".sz", process_set)
    gathered = allgather(data, None if name is None else name + ".t", process_set).numpy()
    out, start = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(gathered[start:start + n].tobytes()))
        start += n
    return out
