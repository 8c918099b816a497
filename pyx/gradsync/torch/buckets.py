"""The buckets of gradsync.torch's DistributedOptimizer: one slot per
parameter, buckets over the slots in reverse parameter order, and the flat
accumulation buffers (arenas) that hold the buckets back to back."""
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DoneRequest:
    """The request of a bucket that needed no communication (one rank)."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors

    def test(self):
        return True

    @property
    def done(self):
        return True


class Slot:
    """One parameter: its accumulator view and its count of gradients
    received since the last synchronize()."""

    __slots__ = ("index", "name", "param", "bucket", "view", "grad", "count", "inplace")

    def __init__(self, index, name, param):
        self.index, self.name, self.param = index, name, param
        self.bucket = self.view = self.grad = None
        self.count = 0
        # p.grad may be the accumulator itself (backward then adds into it):
        # when the accumulator has the parameter's dtype (float32, float64)
        self.inplace = acc_dtype(param) == param.dtype


class Bucket:
    __slots__ = ("index", "slots", "buffer", "wire", "feedback", "remaining", "request")

    def __init__(self, index, slots):
        self.index, self.slots = index, slots
        self.buffer = self.wire = self.feedback = self.request = None
        self.remaining = len(slots)


def acc_dtype(p):
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def plan_buckets(slots, bucket_bytes):
    """Buckets over ``slots`` in reverse parameter order, each at most
    ``bucket_bytes`` of accumulator (a parameter larger than that gets a
    bucket of its own), a new bucket wherever the device or the
    accumulation dtype changes."""
    buckets, cur, cur_bytes, cur_key = [], [], 0, None
    for s in reversed(slots):
        key = (s.param.device, acc_dtype(s.param))
        nbytes = s.param.numel() * (8 if key[1] == torch.float64 else 4)
        if cur and (key != cur_key or cur_bytes + nbytes > bucket_bytes):
            buckets.append(Bucket(len(buckets), cur))
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += nbytes
        cur_key = key
    if cur:
        buckets.append(Bucket(len(buckets), cur))
    return buckets


def arenas(groups, dtype_of=acc_dtype):
    """One flat zeroed allocation per (device, dtype) holding ``groups``
    (lists of slots) back to back, the dtype ``dtype_of(param)``. Returns
    (arenas, [flat slice per group], {slot: view shaped like its parameter})."""
    sizes = {}
    for g in groups:
        key = (g[0].param.device, dtype_of(g[0].param))
        sizes[key] = sizes.get(key, 0) + sum(s.param.numel() for s in g)
    arenas = {k: torch.zeros(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
    offsets = dict.fromkeys(arenas, 0)
    flats, views = [], {}
    for g in groups:
        key = (g[0].param.device, dtype_of(g[0].param))
        start = off = offsets[key]
        for s in g:
            n = s.param.numel()
            views[s] = arenas[key][off:off + n].view(s.param.shape)
            off += n
        offsets[key] = off
        flats.append(arenas[key][start:off])
    return list(arenas.values()), flats, views


