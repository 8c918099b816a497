"""Torch tensors as the engine (gradsync.horovod.engine) takes them: the
call tag of an operation's name and shapes, the caller's CUDA stream on the
executor thread, byte views of dtypes gradsync does not reduce, and the
zeros a joined rank contributes."""
import torch

_WIRE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
         torch.int32, torch.int64)
_TORCH_DTYPES = {str(d).rsplit(".", 1)[-1]: d for d in
                 _WIRE + (torch.int16, torch.bool, torch.complex64, torch.complex128)}


def _tag(tensors, rows_may_differ=False):
    """The engine's tag maker for these tensors (engine docstring): the
    operation's full name and its tensors' shapes (without dim 0 where it
    may differ by rank), since gradsync compares element counts and Horovod
    compares shapes too."""
    shapes = tuple(tuple(t.shape[1:]) if rows_may_differ else tuple(t.shape) for t in tensors)
    return lambda full: repr((full, shapes))


def _stream(tensors):
    """For CUDA tensors: a context that makes the caller's current stream
    current on the executor thread (gradsync orders its work after it)."""
    if not tensors or tensors[0].device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(tensors[0].device)
    return lambda: torch.cuda.stream(stream)


def _zeros_on(device):
    def zeros(dtype_name, shape):
        return torch.zeros(shape, dtype=_TORCH_DTYPES[dtype_name], device=device)
    return zeros


def _contiguous(t, what="tensor"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().contiguous()


def _as_bytes(t):
    """t itself when gradsync takes its dtype, else its bytes (a uint8 view
    with the same dim 0): data movement does not care about dtypes."""
    if t.dtype in _WIRE:
        return t
    return t.reshape(t.shape[0] if t.dim() else 1, -1).view(torch.uint8)


def _from_bytes(out, like):
    if like.dtype in _WIRE:
        return out
    return out.view(like.dtype).reshape((-1,) + tuple(like.shape[1:]))
