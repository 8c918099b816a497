"""Horovod's gradient compression classes (the interface scripts pass as
``compression=``)."""
import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        """Returns the tensor to send and what decompress needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Undoes compress."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        """The tensor itself."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """The tensor itself."""
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; others unchanged."""

    @staticmethod
    def compress(tensor):
        """A float16 copy of a floating tensor (other dtypes as they are)."""
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Back to the original dtype."""
        if ctx is not None and ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class Compression:
    """``Compression.none`` (default) and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
