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
import os
import socket
import time

import numpy as np

from gradsync import _core, _world
from gradsync._shrink import _Member, _members, _watch

_TICKETS = "gradsync/grow/tickets"
_POLL_SECONDS = 0.005
_admitted = 0  # the tickets admitted into this process's world so far


def _check_store(store):
    if not (callable(getattr(store, "add", None)) and callable(getattr(store, "check", None))):
        raise _core.UnsupportedError(
            f"growing a world needs a rendezvous store with add (torch's TCPStore and "
            f"FileStore have it); {type(store).__name__} has not")


def join_running(store, timeout=None):
    """Joins the world the processes at ``store`` run (gs.init made it):
    waits until its members admit this process at a step boundary, then
    returns gradsync's world (an mpi4py intracommunicator, as gs.init).
    JoinError when nobody admits it within ``timeout`` seconds (default
    GRADSYNC_TIMEOUT_SECONDS, else 300)."""
    global _admitted
    _check_store(store)
    if _world._world is not None:
        raise ValueError("this process is in a world already (gs.init or a join)")
    timeout = _world._timeout() if timeout is None else float(timeout)
    ticket = int(store.add(_TICKETS, 1))
    store.set(f"gradsync/grow/want/{ticket}", f"{socket.gethostname()} {os.getpid()}".encode())
    deadline = time.monotonic() + timeout
    key = f"gradsync/grow/admit/{ticket}"
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise _world.JoinError(
                f"gradsync grow: ticket {ticket} waited {timeout:g} s and no member admitted it: "
                "are the members training with gradsync.elastic (which admits at each commit)?")
        time.sleep(_POLL_SECONDS)
    generation, rank, size, first, upto, old_generation, old_size = (
        bytes(store.get(key)).decode().split())
    members = _members(store, old_generation, int(old_size))
    everyone = _with_newcomers(store, members, range(int(first), int(upto) + 1))
    _admitted = int(upto)
    try:
        return _world.join(store, int(rank), int(size), timeout, generation=generation,
                           watch=_watch(everyone, range(len(everyone))))
    finally:
        for m in everyone:
            m.close()


def _with_newcomers(store, members, tickets):
    return members + [_Member(bytes(store.get(f"gradsync/grow/want/{t}")).decode())
                      for t in tickets]


def pending(comm):
    """The largest ticket count any member has seen (collective over comm,
    one small allreduce); above the admitted count, newcomers wait."""
    if _world._joined is None:
        return 0
    store = _world._joined[0]
    if not callable(getattr(store, "add", None)):
        return 0  # nobody can take a ticket at this store: join_running says why
    seen = np.array([int(store.add(_TICKETS, 0))], np.int64)
    comm.allreduce_(seen, op="max")
    return int(seen[0])


def grow_world(upto):
    """Admits tickets up to ``upto`` and joins members and newcomers into a
    new world; returns it. Collective over the members. A newcomer gone
    before the join ends: JoinError on every member (their world stands)."""
    global _admitted
    store, generation, rank, size, timeout = _world._joined
    first = _admitted + 1
    new_size = size + upto - _admitted
    new_generation = f"{generation}.g{upto}"
    if rank == 0:
        for i, t in enumerate(range(first, upto + 1)):
            store.set(f"gradsync/grow/admit/{t}", f"{new_generation} {size + i} {new_size} "
                      f"{first} {upto} {generation} {size}".encode())
    old = _world._world
    _admitted = upto  # given up on if the join fails: the members' world stands
    everyone = _members(store, generation, size)
    try:
        everyone = _with_newcomers(store, everyone, _wait_wanted(store, first, upto, timeout))
        world = _world.join(store, rank, new_size, timeout, generation=new_generation,
                            watch=_watch(everyone, range(len(everyone))))
    finally:
        for m in everyone:
            m.close()
    if old is not None:
        old.Free()
    return world


def _wait_wanted(store, first, upto, timeout):
    """The tickets' where-they-live keys (written just after the ticket)."""
    keys = [f"gradsync/grow/want/{t}" for t in range(first, upto + 1)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise _world.JoinError("gradsync grow: a newcomer took a ticket and never said where "
                                   "it lives")
        time.sleep(_POLL_SECONDS)
    return range(first, upto + 1)
