"""Training that goes on when a rank is lost (docs/GUIDE.md, "Losing a rank";
docs/DESIGN.md section 16).

    state = gs.elastic.State(weights=w, step=0)

    def train(state, comm):
        while state.step < steps:
            g = gradient(state.weights, gs.elastic.shard(data, comm))
            comm.allreduce_(g, op="average")
            state.weights -= lr * g
            state.step += 1
            state.commit()              # a step boundary: what a loss goes back to
        return state.weights

    weights = gs.elastic.run(train, state)

When a peer is lost (``gs.PeerLostError``, or any error raised while a
member of the joined world is gone: DDP re-raises a collective's error as a
RuntimeError), ``run`` shrinks the
communicator to the survivors (``Communicator.shrink``), puts the state back
to its last commit, makes every survivor hold the lowest-ranked one's
(a rank that completed the lost step and committed it and one that did not
then agree), and calls ``train`` again with the new communicator. Nothing
is written to a file: the commit lives in each survivor's memory.
"""
import pickle

import numpy as np

from gradsync import _core, _shrink, _world
from gradsync.communicator import default_communicator


class _Grows(Exception):
    """Raised by a commit inside run() when newcomers wait to join."""


def _is_array(value):
    return isinstance(value, np.ndarray) or (hasattr(value, "copy_") and hasattr(value, "clone"))


def _saved(value):
    if isinstance(value, np.ndarray):
        return value.copy()
    if _is_array(value):  # a torch tensor
        return value.detach().clone()
    return pickle.loads(pickle.dumps(value))  # a deep copy that leaves nothing shared


class State:
    """What training must not lose, by name: arrays (NumPy, or torch
    tensors: restored in place, so optimizers and models holding them see
    the restored values) and plain values (numbers, lists, dicts: anything
    picklable). Read and set them as attributes. ``commit()`` saves the
    current values; ``restore()`` goes back to the last commit (made at
    construction too); ``sync(comm)`` gives every rank rank 0's values."""

    def __init__(self, **values):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_commit", None)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "_after_commit", None)  # run()'s look for newcomers
        self.commit()

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the elastic State has no {name!r}") from None

    def __setattr__(self, name, value):
        if name not in self._values:
            raise AttributeError(f"the elastic State has no {name!r} (give it to State(...))")
        self._values[name] = value

    def commit(self):
        """Saves every value: a loss from now on comes back here."""
        object.__setattr__(self, "_commit", {k: _saved(v) for k, v in self._values.items()})
        object.__setattr__(self, "commits", self.commits + 1)
        if self._after_commit is not None:
            self._after_commit()

    def restore(self):
        """Every value as at the last commit (arrays in place)."""
        for k, saved in self._commit.items():
            value = self._values[k]
            if isinstance(value, np.ndarray) and value.shape == saved.shape:
                np.copyto(value, saved)
            elif _is_array(value) and tuple(value.shape) == tuple(saved.shape):
                value.copy_(saved)
            else:
                self._values[k] = _saved(saved)

    def sync(self, comm):
        """Every rank takes rank 0's values (arrays in place) and commits
        them. Collective."""
        arrays = [k for k, v in self._values.items() if _is_array(v)]
        others = {k: v for k, v in self._values.items() if k not in arrays}
        if arrays:
            comm.broadcast_([self._values[k] for k in arrays], root=0)
        blob = np.frombuffer(pickle.dumps(others), np.uint8) if comm.rank == 0 else None
        length = np.array([0 if blob is None else blob.size], np.int64)
        comm.broadcast_(length, root=0)
        data = blob.copy() if blob is not None else np.empty(int(length[0]), np.uint8)
        comm.broadcast_(data, root=0)
        self._values.update(pickle.loads(data.tobytes()))
        hook = self._after_commit
        object.__setattr__(self, "_after_commit", None)
        try:
            self.commit()
        finally:
            object.__setattr__(self, "_after_commit", hook)


def can_change():
    """Whether gradsync's world can shrink and grow: it was joined from MPI
    singletons through a rendezvous store (torchrun, gradsyncrun --min-np,
    gs.init(store)); MPI's own world (mpiexec, srun) cannot."""
    return _world.joined()


def lost_ranks():
    """The ranks of gradsync's world whose processes, on this host, are gone
    (empty on MPI's world): how a loss is told from another error when a
    framework re-raised it as something else."""
    return _shrink.lost_members()


def shrink_world(lost=()):
    """Shrinks gradsync's world to the processes still alive, as
    ``Communicator.shrink`` does, for a layer whose communicators are
    already closed (the Horovod drop-in's reset); returns the new world (an
    mpi4py intracommunicator). ``lost``: ranks known to be gone (a hint).
    Collective over the survivors."""
    return _shrink.shrink_world(lost)


def shard(items, comm):
    """This rank's share of ``items`` (every size-th from its rank): what it
    trains on in the world as it is now."""
    return items[comm.rank::comm.size]


def join_running(store, timeout=None):
    """For a process started after the others (a replacement, more
    capacity): joins the world the processes at ``store`` train in, at
    their next commit inside ``run``; returns gradsync's world (as gs.init).
    Then call ``run`` as they do: it starts with their state. JoinError
    when nobody admits it within ``timeout`` s (default
    GRADSYNC_TIMEOUT_SECONDS, else 300)."""
    return _world.join_running(store, timeout)


def run(train, state, comm=None, *, on_change=None, max_losses=None, grow=True):
    """Calls ``train(state, comm)`` until it returns, and returns what it
    returns. When a peer is lost (PeerLostError; an error raised while a
    member is gone; a gs.TimeoutError on a joined world, which may be a
    member lost on another host): shrinks ``comm`` to the survivors,
    restores ``state`` to its last commit, syncs it from the new rank 0,
    calls ``on_change(comm)`` (rebuild what depends on the world: a DDP
    model, a sampler) and calls ``train`` again. ``max_losses``: how many
    losses to survive (None: while ranks remain); past it the
    PeerLostError goes up. With ``grow``, each ``state.commit()`` also
    admits processes waiting in ``join_running`` (one small allreduce
    among the ranks: they decide alike): the world grows, the state goes to
    the newcomers, ``on_change`` and ``train`` as after a loss.
    ``comm``: default, gradsync's world."""
    comm = default_communicator(comm)
    losses = 0
    changed = False
    while True:
        if grow:
            object.__setattr__(state, "_after_commit", lambda: _look_for_newcomers(comm))
        try:
            state.sync(comm)
            if changed and on_change is not None:
                on_change(comm)
            return train(state, comm)
        except _Grows:
            comm = comm.grow()
        except Exception as exc:  # noqa: BLE001 (a loss, however a framework wrapped it)
            lost = exc if isinstance(exc, _core.PeerLostError) else lost_ranks()
            # a peer on another host cannot be seen to die: a wait that ran out
            # of time may be one lost there (the survivors' agreement tells)
            if not lost and not (isinstance(exc, _core.TimeoutError) and can_change()):
                raise
            losses += 1
            if max_losses is not None and losses > max_losses:
                raise
            comm = comm.shrink(lost)
            state.restore()
        finally:
            object.__setattr__(state, "_after_commit", None)
        changed = True


def _look_for_newcomers(comm):
    if comm.newcomers_waiting():
        raise _Grows()
