"""Horovod's elastic API, framework-neutral part, on gradsync: State
(commit/restore/sync, reset callbacks), ObjectState and the run()
decorator that restores and re-forms the world after a HorovodInternalError.

On a world joined from singletons (``gradsyncrun -np N --min-np M``,
``horovod.run(min_np=...)``, torchrun) the world changes as Horovod's
elastic driver changes it: a reset after a lost rank shrinks it to the
survivors (gradsync's Communicator.shrink), and ``commit()`` admits the
processes waiting to join (gradsyncrun's replacements: HostsUpdatedInterrupt
on every rank at the same commit, then a reset that grows the world). On
MPI's fixed world (mpiexec) a reset re-forms the same world, and a world
that would need other processes raises NotImplementedError naming what is
missing. Host discovery scripts are not there.
"""
import copy
import functools

import gradsync as gs
from gradsync.horovod import basics
from gradsync.horovod import state as _state
from gradsync.horovod.errors import HorovodInternalError

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "run_fn"]

MISSING = ("a world joined from singletons (gradsyncrun --min-np, horovod.run(min_np=...), "
           "torchrun): gradsync runs on the fixed world mpiexec started")


class HostsUpdatedInterrupt(RuntimeError):
    """Raised from commit() on every rank when processes wait to join the
    world (a joined world's newcomers); the reset that follows admits them."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class State:
    """What an elastic job keeps across a reset: save()/restore() a copy,
    sync() from rank 0, commit() = save() and a check for host updates.
    ``on_reset`` callbacks run after every reset."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object
        self._get_rank = get_rank or basics.rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each reset."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's driver calls this; gradsync asks the store at commit()."""

    def commit(self):
        """Saves the state (the point restore() goes back to), then checks
        for processes waiting to join."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """HostsUpdatedInterrupt when processes wait to join this joined
        world (collective: one small allreduce, so every rank raises at the
        same commit); nothing on MPI's fixed world."""
        if gs.elastic.can_change() and basics.is_initialized() and \
                _state.world_engine().comm.newcomers_waiting():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def reset(self):
        """Called on a reset (after restore, before sync)."""


class ObjectState(State):
    """A State of picklable attributes (``ObjectState(bcast_object, epoch=0)``:
    ``state.epoch``)."""

    def __init__(self, bcast_object, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


def run_fn(func, reset):
    """Horovod's elastic run(): ``func(state, ...)`` is called after
    state.sync(); a HorovodInternalError restores the last commit, resets
    (``reset()``: the world re-formed) and calls it again; a
    HostsUpdatedInterrupt resets without restoring."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()
    return wrapper


def reset_world(expected_size=None):
    """Re-forms the world after a failure or a host update: shutdown() and
    init() on every rank, in between, on a joined world, a shrink to the
    survivors (a member is gone: nothing is sent to it) or a grow by the
    processes waiting to join. On MPI's world only the same world can be
    re-formed."""
    lost = gs.elastic.lost_ranks()
    if lost:
        if not gs.elastic.can_change():
            raise NotImplementedError(f"going on without a lost rank needs {MISSING}")
        basics.shutdown(announce=False)  # nothing goes to the lost rank
        gs.elastic.shrink_world(lost)
        basics.init()
        return
    comm = _state.world_engine().comm if basics.is_initialized() else None
    new = None
    if gs.elastic.can_change() and comm is not None:
        new = comm.grow()  # the waiting newcomers, if any (collective)
        new = None if new is comm else new
    elif expected_size is not None and expected_size != basics.size():
        raise NotImplementedError(f"a world of {expected_size} processes (this one has "
                                  f"{basics.size()}) needs {MISSING}")
    basics.shutdown()
    basics.init(comm=new)
