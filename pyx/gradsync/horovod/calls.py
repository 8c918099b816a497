"""What the engine queues: a Call (one submitted operation, its arrays
and what becomes of it), the signature of zero-element tensors that carries
its name (gradsync.horovod.engine's docstring), and the zeros a joined rank
contributes by default."""
import hashlib
import threading
import time

import numpy as np

import gradsync as gs

_QUEUED, _RUNNING, _DONE, _RAISED = range(4)
_SIG_DTYPES = (np.dtype(np.float16), np.dtype(gs.bfloat16), np.dtype(np.float32),
               np.dtype(np.float64))
_SIG_SLOTS = 12


def signature_dtypes(name):
    """The dtypes of the zero-element tensors that carry ``name`` (None:
    no signature)."""
    if name is None:
        return ()
    h = int.from_bytes(hashlib.sha1(str(name).encode()).digest()[:3], "little")
    return tuple(_SIG_DTYPES[(h >> (2 * i)) & 3] for i in range(_SIG_SLOTS))


def _dtype_name(dtype):
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def _np_dtype(name):
    return np.dtype(gs.bfloat16) if name == "bfloat16" else np.dtype(name)


def numpy_zeros(dtype_name, shape):
    return np.zeros(shape, _np_dtype(dtype_name))


class Call:
    """One submitted operation: its arrays (data, then signature), what it
    does, its result, and what becomes of it."""

    __slots__ = ("kind", "arrays", "ndata", "args", "name", "result", "error", "state",
                 "finish", "done", "observed", "submitted", "context", "unnamed", "site")

    def __init__(self, kind, arrays, ndata, args, name, finish, context, unnamed):
        self.kind, self.arrays, self.ndata, self.args = kind, arrays, ndata, args
        self.name, self.finish, self.context, self.unnamed = name, finish, context, unnamed
        self.result = self.error = None
        self.state = _QUEUED
        self.done = threading.Event()
        self.observed = False
        self.submitted = time.monotonic()
        self.site = gs._core.flight_site_here()  # the submitting line, for the record

    def describe(self):
        """What a rank that joined needs to take part: kind, arguments, the
        data's (dtype, shape) and the signature's dtypes."""
        args = {k: v for k, v in self.args.items() if k not in ("out", "run")}
        specs = [(_dtype_name(a.dtype), tuple(a.shape)) for a in self.arrays[:self.ndata]]
        sig = [_dtype_name(a.dtype) for a in self.arrays[self.ndata:]]
        return (self.kind, args, specs, sig)

    def __repr__(self):
        return self.name
