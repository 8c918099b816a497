"""Horovod's SyncBatchNorm: batch normalization over the batch of every
rank, written on gradsync allreduces (CPU and CUDA alike)."""
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradsync.horovod import state
from gradsync.horovod.basics import Sum
from gradsync.horovod.process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


def _sum_over_ranks(tensor, process_set):
    from gradsync.horovod.torch.mpi_ops import allreduce_

    return allreduce_(tensor, op=Sum, process_set=process_set)


def _global_stats(x, eps, process_set):
    """(mean, invstd, variance, count) per channel over every rank's batch:
    one fused float64 allreduce of the sums, sums of squares and count."""
    dims = [0] + list(range(2, x.dim()))
    xd = x.detach().double()
    channels = x.shape[1]
    stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                       torch.tensor([x.numel() / channels], dtype=torch.float64,
                                    device=x.device)])
    _sum_over_ranks(stats, process_set)
    count = float(stats[-1])
    mean = stats[:channels] / count
    var = (stats[channels:2 * channels] / count - mean * mean).clamp_min(0)
    return mean, torch.rsqrt(var + eps), var, count


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with the global statistics;
    backward: one fused allreduce of sum(dy) and sum(dy * xhat) (the
    statistics depend on every rank's x)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, process_set):
        shape = [1, -1] + [1] * (x.dim() - 2)
        xhat = ((x.detach().double() - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        y = xhat if weight is None else xhat * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count, ctx.process_set = count, process_set
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, dy.dim()))
        shape = [1, -1] + [1] * (dy.dim() - 2)
        dyd, xhatd = dy.double(), xhat.double()
        local = torch.cat([dyd.sum(dims), (dyd * xhatd).sum(dims)])
        channels = local.numel() // 2
        dweight = dbias = None
        if weight is not None:  # this rank's: DistributedOptimizer averages them
            dbias, dweight = local[:channels].to(dy.dtype), local[channels:].to(dy.dtype)
        total = _sum_over_ranks(local.clone(), ctx.process_set)
        scale = invstd * (weight.double() if weight is not None else 1.0) / ctx.count
        dx = scale.view(shape) * (ctx.count * dyd - total[:channels].view(shape)
                                  - xhatd * total[channels:].view(shape))
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose statistics cover every rank's batch
    (Horovod's SyncBatchNorm; same arguments as torch.nn.BatchNorm1d/2d/3d).
    In training, the mean and variance are those of the concatenated batch
    and the running statistics get its unbiased variance; the weight and
    bias gradients are this rank's (DistributedOptimizer averages them).
    In evaluation it is plain batch normalization with the running
    statistics."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or not state.initialized():
            return super().forward(input)
        mean, invstd, var, count = _global_stats(input, self.eps, self.process_set)
        if self.track_running_stats:
            self._update_running_stats(mean, var, count)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, count,
                                            self.process_set)

    def _update_running_stats(self, mean, var, count):
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                 else self.momentum)
            unbiased = var * (count / max(count - 1.0, 1.0))
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
