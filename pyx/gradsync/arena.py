"""gs.Arena: one contiguous allocation handing out views, so a model's whole
gradient list reduces as one message with no packing (the fusion engine sees
the views back to back and reduces them where they are)."""
import numpy as np

from gradsync import _core


def _shape(s):
    if isinstance(s, (int, np.integer)):
        return (int(s),)
    shape = tuple(int(d) for d in s)
    if any(d < 0 for d in shape):
        raise ValueError(f"shapes: {s!r} has a negative dimension")
    return shape


class Arena:
    """``Arena(shapes, dtype=float32)``: ``views[i]`` is an array of
    ``shapes[i]``; the views sit back to back, in order, in ``buffer`` (one
    1-D array), so ``comm.allreduce_(arena.views)`` or
    ``comm.allreduce_(arena.buffer)`` moves one message with zero copies.
    Host memory. On a GPU, the same layout is one ``DeviceArray`` (or torch
    tensor) viewed through ``torch.from_dlpack(buf)[o:o + n].view(shape)``:
    gradsync takes those views zero-copy, and back to back they fuse the
    same way (gradsync.torch.DistributedOptimizer does exactly that)."""

    def __init__(self, shapes, dtype=np.float32):
        self.shapes = [_shape(s) for s in shapes]
        self.dtype = np.dtype(dtype)
        counts = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = list(np.cumsum([0] + counts[:-1], dtype=np.int64)) if counts else []
        self.offsets = [int(o) for o in self.offsets]
        total = int(sum(counts))
        if self.dtype not in _core._DTYPES:
            raise TypeError(f"Arena: dtype {self.dtype} is not one gradsync supports")
        self.buffer = np.zeros(total, dtype=self.dtype)
        self.views = [self.buffer[o:o + n].reshape(s)
                      for o, n, s in zip(self.offsets, counts, self.shapes)]

    def __len__(self):
        return len(self.views)

    def __getitem__(self, i):
        return self.views[i]

    def __iter__(self):
        return iter(self.views)

    @property
    def nbytes(self):
        return self.buffer.nbytes

    def zero_(self):
        """Every element to +0.0 (one kernel call); returns the arena."""
        _core.zero_([self.buffer])
        return self

    def __repr__(self):
        return (f"<gradsync.Arena {len(self.views)} views, {self.buffer.size} x "
                f"{self.dtype.name}>")
