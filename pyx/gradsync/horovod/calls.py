"""What the engine queues: a Call (one submitted operation: its arrays,
what becomes of it, and the call tag its name travels as; see
gradsync.horovod.engine's docstring), and the zeros a joined rank
contributes by default."""
import threading
import time

import numpy as np

import gradsync as gs

_QUEUED, _RUNNING, _DONE, _RAISED = range(4)
# The tag of the negotiation's STATUS allreduce: no operation's name has it.
STATUS_TAG = "gradsync.horovod.status"


def _dtype_name(dtype):
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def _np_dtype(name):
    return np.dtype(gs.bfloat16) if name == "bfloat16" else np.dtype(name)


def numpy_zeros(dtype_name, shape):
    return np.zeros(shape, _np_dtype(dtype_name))


class Call:
    """One submitted operation: its arrays, what it does, the call tag its
    full name travels as (``tag``, a str: gradsync hashes it to 64 bits),
    its result, and what becomes of it."""

    __slots__ = ("kind", "arrays", "args", "name", "tag", "result", "error", "state",
                 "finish", "done", "observed", "submitted", "context", "unnamed", "site")

    def __init__(self, kind, arrays, args, name, tag, finish, context, unnamed):
        self.kind, self.arrays, self.args, self.name, self.tag = kind, arrays, args, name, tag
        self.finish, self.context, self.unnamed = finish, context, unnamed
        self.result = self.error = None
        self.state = _QUEUED
        self.done = threading.Event()
        self.observed = False
        self.submitted = time.monotonic()
        self.site = gs.flight_site_here()  # the submitting line, for the record

    def describe(self):
        """What a rank that joined needs to take part: kind, arguments, the
        data's (dtype, shape) and the call tag."""
        args = {k: v for k, v in self.args.items() if k not in ("out", "run")}
        specs = [(_dtype_name(a.dtype), tuple(a.shape)) for a in self.arrays]
        return (self.kind, args, specs, self.tag)

    def __repr__(self):
        return self.name
