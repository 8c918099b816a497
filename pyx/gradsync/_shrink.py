"""Shrinking a joined world to its survivors (docs/DESIGN.md section 16,
docs/GUIDE.md "Losing a rank").

A world joined from MPI singletons through a rendezvous store (``_world``)
outlives the loss of a member: each survivor registers under the store,
waits until every member of the old world has either registered or is
known to be gone, and offers the survivors it saw with the store's atomic
``compare_set``. The first offer stands and every survivor reads it: one
answer everywhere, whoever is slow, even when more ranks die meanwhile
(they are in the answer, and the join that follows fails on every
survivor, which then agrees again one epoch later). The survivors, ranked
in their old order, then join a new world through the same store: MPI's
dynamic-process calls between live processes only, so nothing is ever
posted to the lost ones.

Gone: a member on this host whose process has ended (its pidfd is
readable, as the C side's watch, or /proc has no such process). A member on
another host cannot be seen from here: it counts as lost when it has not
registered by the timeout.
"""
import time

from mpi4py import MPI  # gradsync/__init__ loads it first, at gradsync's thread level

from gradsync import _core, _members, _world

_POLL_SECONDS = 0.005
_RETRIES = 8  # agreements one shrink() tries while members keep failing


class _Agreement:
    """One epoch's agreement on the survivors, over the store."""

    def __init__(self, store, base, epoch, rank, size, timeout):
        self.store, self.rank, self.size = store, rank, size
        self.prefix = f"gradsync/shrink/{base}/{epoch}/"
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout

    def key(self, name):
        return self.prefix + name

    def has(self, name):
        return self.store.check([self.key(name)])

    def survivors(self, members, lost):
        """Registers this rank and returns the old ranks that registered,
        once every other one is known to be gone (or the timeout passed)."""
        self.store.set(self.key(f"here/{self.rank}"), b"1")
        while True:
            here = [r for r in range(self.size) if self.has(f"here/{r}")]
            missing = [r for r in range(self.size) if r not in here]
            if all(r in lost or members[r].gone() for r in missing):
                return here
            if time.monotonic() > self.deadline:  # members elsewhere that never came
                return here
            if self.has("members"):  # another survivor decided already
                return None
            time.sleep(_POLL_SECONDS)

    def decide(self, offer):
        """The first offer made, this one or another survivor's."""
        text = ",".join(map(str, offer)).encode()
        got = self.store.compare_set(self.key("members"), b"", text)
        return [int(r) for r in bytes(got).decode().split(",")]

    def decided(self):
        return [int(r) for r in bytes(self.store.get(self.key("members"))).decode().split(",")]


def _check_store(store):
    if not callable(getattr(store, "compare_set", None)):
        raise _core.UnsupportedError(
            f"shrink needs a rendezvous store with compare_set (torch's TCPStore and FileStore "
            f"have it); {type(store).__name__} has not")


def lost_members():
    """The ranks of gradsync's joined world whose processes (on this host)
    are gone; empty when the world is not a joined one. What tells a loss
    wrapped by a framework (DDP's reducer re-raises a collective's error
    as a RuntimeError) from any other error."""
    if _world._joined is None:
        return []
    store, generation, _rank, size, _timeout = _world._joined
    try:
        members = _members.of_world(store, generation, size)
    except Exception:  # noqa: BLE001 (the store is gone: nothing to tell from it)
        return []
    try:
        return [r for r, m in enumerate(members) if m.gone()]
    finally:
        for m in members:
            m.close()


def shrink_world(lost=()):
    """Agrees with the other survivors on who is left and joins them into a
    new world; returns it (an mpi4py intracommunicator, also gradsync's
    world from now on). ``lost``: old ranks already known to be gone.
    Collective over the survivors."""
    if _world._joined is None:
        raise _core.UnsupportedError(
            "shrink needs a world joined from MPI singletons through a rendezvous (torchrun, "
            "or gs.init(store)): under mpiexec or srun the MPI library "
            "owns the world, and MPI without fault-tolerance extensions cannot drop a rank "
            "from it (docs/GUIDE.md, 'Losing a rank')")
    store, generation, rank, size, timeout = _world._joined
    _check_store(store)
    members = _members.of_world(store, generation, size)
    lost = {int(r) for r in lost}
    old = _world._world
    try:
        for attempt in range(_RETRIES):
            agreement = _Agreement(store, generation, attempt, rank, size, timeout)
            offer = agreement.survivors(members, lost)
            chosen = agreement.decide(offer) if offer is not None else agreement.decided()
            if rank not in chosen:
                raise _core.PeerLostError(
                    f"shrink: this rank (rank {rank} of the old world) registered after the "
                    f"survivors {chosen} agreed without it")
            try:
                world = _world.join(store, chosen.index(rank), len(chosen), timeout,
                                    generation=f"{generation}.{attempt}",
                                    watch=_members.watch(members, chosen))
            except (_world.JoinError, MPI.Exception):
                lost.update(r for r in chosen if members[r].gone())
                continue  # another survivor left during the join: agree again
            break
        else:
            raise _world.JoinError(f"shrink: the survivors could not agree in {_RETRIES} tries")
    finally:
        for m in members:
            m.close()
    if old is not None:
        old.Free()  # local in MPI: no message to the lost members
    return world
