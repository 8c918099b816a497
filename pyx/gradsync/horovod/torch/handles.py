"""Handles: what Horovod's asynchronous PyTorch collectives return (an
integer naming the engine's Call, or a value already known), and poll() and
synchronize() on them."""
import itertools

_handles = {}                 # handle -> _Handle
_next_handle = itertools.count(1)


class _Handle:
    __slots__ = ("engine", "call", "name")

    def __init__(self, engine, call, name):
        self.engine, self.call, self.name = engine, call, name


def _handle(engine, call, name):
    h = next(_next_handle)
    _handles[h] = _Handle(engine, call, name)
    return h


class _Done:
    """A finished call (nothing to communicate)."""

    def __init__(self, value):
        self.value = value


def _done_handle(value):
    h = next(_next_handle)
    _handles[h] = _Handle(None, _Done(value), None)
    return h


class _Raise:
    def __init__(self, exc):
        self.exc = exc


def poll(handle):
    """True once the operation of ``handle`` has finished (synchronize()
    then returns without waiting)."""
    h = _handles.get(handle)
    if h is None or h.engine is None:
        return True
    return h.engine.test(h.call)


def synchronize(handle):
    """Waits for the operation of ``handle`` and returns its output
    (None for an unknown handle)."""
    h = _handles.pop(handle, None)
    if h is None:
        return None
    if h.engine is None:
        value = h.call.value
        if isinstance(value, _Raise):
            raise value.exc
        return value
    return h.engine.wait(h.call)
