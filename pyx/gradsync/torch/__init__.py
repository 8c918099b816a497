"""gradsync.torch: autograd-aware collectives on torch tensors (``gradsync[torch]``).

Tensors go to the C runtime through DLPack without a copy, CPU or CUDA alike;
results come back with ``torch.from_dlpack`` (a NumPy array on the host, a
``gradsync.DeviceArray`` on a GPU), again without a copy. Tensors that require
grad are detached inside the autograd functions, so callers never detach::

    import gradsync as gs
    import gradsync.torch as gst

    comm = gs.Communicator()
    y = gst.all_reduce(x, comm)          # backward: the same all-reduce
    y = gst.AllReduce(comm)(partial)     # backward: identity (row-parallel GEMM)
    g = gst.all_gather(x, comm)          # backward: reduce_scatter
    s = gst.reduce_scatter(x, comm)      # backward: all_gather
    layer = gst.AllSumReduce(P_x, axes_reduce=(1,))   # self-adjoint nn.Module

Every function is collective: every rank of ``comm`` (of the partition, for
AllSumReduce) calls it, forward and backward, in the same order.

``import gradsync`` never imports torch; this module does.
"""
from gradsync.partition import Partition
from gradsync.torch.autograd import (
    AllReduce,
    AllSumReduce,
    all_gather,
    all_reduce,
    reduce_scatter,
    zero_volume_tensor,
)
from gradsync.torch.optimizer import (  # data-parallel training
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["AllReduce", "AllSumReduce", "DistributedOptimizer", "Partition", "all_gather",
           "all_reduce", "broadcast_optimizer_state", "broadcast_parameters", "reduce_scatter",
           "zero_volume_tensor"]
