"""Growing a joined world: processes started later join it at a step
boundary (docs/DESIGN.md section 16, docs/GUIDE.md "Losing a rank").

A newcomer takes a ticket from the rendezvous store (its atomic ``add``)
and says where it lives; then it waits for its admission. The members look
at the ticket count when they are told to (``Communicator.grow_pending``,
which gradsync.elastic calls at each commit) and take the largest count any
of them saw (one small allreduce: they all decide alike, at the same step).
Rank 0 then admits the waiting tickets, in ticket order, as ranks after
the members', and members and newcomers join a new world through the same
store (``_world.join``), watching each other's processes. A newcomer that
is gone before the join ends fails it on everyone; the members then keep
their world as it was.
"""
import numpy as np

from gradsync import _members, _world


def pending(comm):
    """The largest ticket count any member has seen (collective over comm,
    one small allreduce); above the admitted count, newcomers wait."""
    if _world._joined is None:
        return 0
    store = _world._joined[0]
    if not callable(getattr(store, "add", None)):
        return 0  # nobody can take a ticket at this store: join_running says why
    seen = np.array([int(store.add(_members.TICKETS, 0))], np.int64)
    comm.allreduce_(seen, op="max")
    return int(seen[0])


def grow_world(upto):
    """Admits tickets up to ``upto`` and joins members and newcomers into a
    new world; returns it. Collective over the members. A newcomer gone
    before the join ends: JoinError on every member (their world stands)."""
    store, generation, rank, size, timeout = _world._joined
    first = _world._admitted + 1
    new_size = size + upto - _world._admitted
    new_generation = f"{generation}.g{upto}"
    if rank == 0:
        for i, t in enumerate(range(first, upto + 1)):
            store.set(f"gradsync/grow/admit/{t}", f"{new_generation} {size + i} {new_size} "
                      f"{first} {upto} {generation} {size}".encode())
    old = _world._world
    _world._admitted = upto  # given up on if the join fails: the members' world stands
    everyone = _members.of_world(store, generation, size)
    try:
        everyone += _members.newcomers(store, first, upto, timeout)
        world = _world.join(store, rank, new_size, timeout, generation=new_generation,
                            watch=_members.watch(everyone, range(len(everyone))))
    finally:
        for m in everyone:
            m.close()
    if old is not None:
        old.Free()
    return world
