"""Error feedback for the low-precision wire formats (docs/GUIDE.md,
"Low-precision wire formats").

``comm.allreduce_(grads, wire="float8_e4m3", residual=ef)`` adds ``ef``'s
residual to each tensor before it is encoded and leaves in it what the
call's roundings lost (this rank's input rounding and the output rounding
of the shard it owned), so the next step sends it: over steps the sum of
the compressed results tracks the sum of the exact ones, with an error
that stays bounded instead of adding up.
"""
import numpy as np

from gradsync._core import WIRES, ArgumentError, to_device

__all__ = ["ErrorFeedback", "WIRES"]


_DLPACK_CUDA = 2


def _zeros_like_memory(t, n):
    """n float32 zeros in t's memory: host (NumPy), or t's CUDA device (a
    torch tensor for a torch tensor, else a gs.DeviceArray)."""
    where = getattr(t, "__dlpack_device__", None)
    kind, index = where() if callable(where) else (1, 0)
    if kind != _DLPACK_CUDA:
        return np.zeros(n, np.float32)
    if type(t).__module__.split(".")[0] == "torch":
        import torch
        return torch.zeros(n, dtype=torch.float32, device=t.device)
    return to_device(np.zeros(n, np.float32), int(index))


def _count(t):
    numel = getattr(t, "numel", None)  # torch tensors
    if callable(numel):
        return int(numel())
    return int(np.prod(np.shape(t), dtype=np.int64))


class ErrorFeedback:
    """The residuals of one list of tensors that is allreduced step after
    step (one object per list: gradients of one model, one bucket): float32
    host arrays, zero at first, made at the first call and kept. A list of a
    different length or element counts is an error (``reset()`` first)."""

    def __init__(self):
        self._residuals = None

    def residuals(self, tensors):
        """The float32 residual arrays for ``tensors`` (one array or a list)."""
        arrays = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        counts = [_count(t) for t in arrays]
        if self._residuals is None:
            self._residuals = [_zeros_like_memory(t, n) for t, n in zip(arrays, counts)]
        elif [_count(r) for r in self._residuals] != counts:
            raise ArgumentError(
                "residual: this ErrorFeedback holds residuals for element counts "
                f"{[_count(r) for r in self._residuals]}, not {counts}; use one ErrorFeedback "
                "per list of tensors, or reset() it", 1)
        return self._residuals if isinstance(tensors, (list, tuple)) else self._residuals[0]

    def reset(self):
        """Forgets the residuals (the next call starts from zero)."""
        self._residuals = None

    @property
    def state(self):
        """The residual arrays (None before the first call)."""
        return self._residuals
