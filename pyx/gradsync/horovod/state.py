"""The process-wide state of gradsync.horovod between init() and shutdown():
the global engine, the registered process sets, the topology."""
from gradsync.horovod.calls import numpy_zeros

_world = None          # the global process set's Engine
_sets = []             # registered ProcessSets, global first
_next_id = 0
_topology = {}         # rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous
_zeros = numpy_zeros   # what joined ranks contribute, by (dtype name, shape)
_notices = None        # shutdown messages between the processes (notices.Notices)
_timeline = None       # Horovod's timeline (timeline.Timeline)


class NotInitializedError(ValueError):
    """Horovod's message for calls made before hvd.init()."""

    def __init__(self):
        super().__init__("Horovod has not been initialized; use hvd.init().")


def check_initialized():
    if _world is None:
        raise NotInitializedError()


def initialized():
    return _world is not None


def notices():
    return _notices


def timeline():
    return _timeline


def world_engine():
    check_initialized()
    return _world


def world_rank():
    check_initialized()
    return _topology["rank"]


def topology(key):
    check_initialized()
    return _topology[key]


def start(engine, topology_values, notices_=None, timeline_=None):
    global _world, _topology, _next_id, _notices, _timeline
    _world = engine
    _topology = dict(topology_values)
    _notices, _timeline = notices_, timeline_
    _sets.clear()
    _next_id = 0


def stop():
    global _world, _notices
    _world = None
    _notices = None
    _sets.clear()


def next_set_id():
    global _next_id
    sid = _next_id
    _next_id += 1
    return sid


def add_set(ps):
    _sets.append(ps)


def remove_set(ps):
    if ps in _sets:
        _sets.remove(ps)
        return True
    return False


def process_sets():
    return list(_sets)


def zeros_factory():
    return _zeros


def set_zeros_factory(fn):
    """The framework layer's zeros (torch tensors on the joining device)."""
    global _zeros
    _zeros = fn
    for ps in _sets:
        if ps._engine is not None:
            ps._engine.zeros = fn
