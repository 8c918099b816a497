"""ONNX Runtime's ZeRO layout for the sharded collectives."""
from gradsync import _core


class ShardLayout:
    """Where each tensor of a sharded call lives, number for number as ONNX
    Runtime's NcclAllGather / NcclReduceScatter compute it::

        total      = sum(numels)           align = size * 32 (elements)
        padded     = total + align - total % align    (always adds a block)
        rank_count = padded // size        offsets[i] = sum(numels[:i])
        owner(i)   = offsets[i] // rank_count

    A tensor that does not end inside its owner's range raises ValueError.
    """

    def __init__(self, numels, size):
        self.numels = tuple(int(n) for n in numels)
        self.size = int(size)
        (self.total, self.padded, self.rank_count, self.offsets,
         self._owners) = _core.shard_layout(self.numels, self.size)

    def owner(self, i):
        """The rank that owns tensor i."""
        return self._owners[i]

    def owned(self, rank):
        """Indices of the tensors that `rank` owns, in order."""
        return [i for i, o in enumerate(self._owners) if o == rank]

    def __repr__(self):
        return (f"ShardLayout(total={self.total}, padded={self.padded}, "
                f"rank_count={self.rank_count}, owners={list(self._owners)})")
