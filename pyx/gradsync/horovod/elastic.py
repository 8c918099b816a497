"""Horovod's elastic API, framework-neutral part, on gradsync: State
(commit/restore/sync, reset callbacks), ObjectState and the run()
decorator that restores and re-forms the world after a HorovodInternalError.

gradsync runs on MPI's fixed world: the processes are the ones mpiexec
started. What Horovod's elastic driver adds on top of that (host discovery,
horovodrun --min-np/--max-np/--host-discovery-script, starting processes on
new hosts, a world of another size after a reset) is not there: a reset
re-forms the same world (hvd.shutdown() then hvd.init() on every rank, the
state restored to its last commit and synchronized from rank 0), and a
world that would need other processes raises NotImplementedError naming
what is missing.
"""
import copy
import functools

from gradsync.horovod import basics
from gradsync.horovod.errors import HorovodInternalError

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "run_fn"]

MISSING = ("Horovod's elastic driver (host discovery and horovodrun --min-np/--max-np, which "
           "start and stop processes): gradsync runs on the fixed world mpiexec started")


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises this from commit() when hosts were added or removed;
    gradsync's world never changes, so it is never raised by gradsync."""

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
        """Host updates never come on gradsync (MPI's world is fixed)."""

    def commit(self):
        """Saves the state (the point restore() goes back to), then checks
        for host updates (none on gradsync)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Nothing to check: the world mpiexec started does not change."""

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
    """Re-forms the world after a failure: shutdown() then init() on every
    rank. The world is MPI's: a reset to another size is not possible."""
    if expected_size is not None and expected_size != basics.size():
        raise NotImplementedError(f"a world of {expected_size} processes (this one has "
                                  f"{basics.size()}) needs {MISSING}")
    basics.shutdown()
    basics.init()
