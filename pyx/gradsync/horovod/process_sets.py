"""Horovod's process sets on gradsync: each set is a gradsync communicator
(a split of the global one) with its own ordered engine."""
from gradsync import MPI
from gradsync.horovod import state

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class ProcessSet:
    """A set of Horovod processes that run collectives together:
    ``ProcessSet([0, 2])`` (global ranks, sorted) or ``ProcessSet(mpi_comm)``
    (an mpi4py communicator). Register it with ``hvd.init(process_sets=[...])``
    or ``hvd.add_process_set(...)``; then pass it as ``process_set=``.
    Root ranks (``root_rank=``) stay global ranks, as in Horovod."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):

        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
        else:
            try:
                ranks = sorted(ranks_or_comm)
            except TypeError:
                raise ValueError("ProcessSet takes a list of process ranks or an mpi4py "
                                 f"communicator, not {type(ranks_or_comm).__name__}") from None
            if any(not isinstance(r, int) for r in ranks) or len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet: ranks must be distinct ints, got {ranks_or_comm!r}")
            self.ranks = ranks
        self._engine = None

    def size(self):
        """Number of processes in the set (None before it is registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's rank within the set (None if not registered or not
        a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(state.world_rank())

    def included(self):
        """Whether this process belongs to the set (None before ranks are known)."""
        if self.ranks is None:
            return None
        return state.world_rank() in self.ranks

    def engine(self):
        """The set's engine on this rank; ValueError when this rank is not a
        member or the set is not registered."""
        if self.process_set_id is None:
            raise ValueError(f"{self} is not registered: pass it to hvd.init(process_sets=...) "
                             "or hvd.add_process_set()")
        if self._engine is None:
            raise ValueError(f"rank {state.world_rank()} is not a member of {self}")
        return self._engine

    def root_index(self, root_rank):
        """The set-relative index of global rank ``root_rank``."""
        try:
            return self.ranks.index(int(root_rank))
        except ValueError:
            raise ValueError(f"root_rank {root_rank} is not a member of {self}") from None

    def _invalidate(self, why=None):
        """Forgets the set on this rank: its engine is shut down here
        (pending operations raise) and its communicator closed."""
        engine, self._engine = self._engine, None
        if engine is not None and self.process_set_id != 0:
            engine.shutdown_local(why or f"{self} was removed")
            try:
                engine.comm.close()
            except Exception:  # noqa: BLE001 - an abandoned communicator may refuse
                pass
        self.process_set_id = None

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.process_set_id is not None and \
            self.process_set_id == other.process_set_id

    def __hash__(self):
        return id(self)

    def __str__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _register(ps):
    """Creates the set's communicator and gives it an id: an operation of
    the global set (every rank calls it, members and others alike, in the
    same order), so a rank that does not come makes it wait like any other
    operation, and fail with the others when they shut down."""
    from gradsync.horovod.engine import Engine

    world_engine = state.world_engine()
    world = world_engine.comm
    if ps.ranks is None:
        ps.ranks = _members(ps.mpi_comm, world)
    if any(r < 0 or r >= world.size for r in ps.ranks):
        raise ValueError(f"{ps}: ranks must be in [0, {world.size})")
    if any(other.ranks == ps.ranks for other in state.process_sets()
           if other is not ps and other.process_set_id != 0):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    me = state.world_rank()
    member = me in ps.ranks
    # one split serves sets that partition the ranks (ProcessSet(comm) after
    # an MPI Split): each rank lands with its own set's members
    color = min(ps.ranks) if member else -1
    call = world_engine.submit("add_set", [], run=lambda: world.split(color, key=me))
    comm = world_engine.wait(call)
    engine = None
    if member:
        engine = Engine(comm, ps.ranks, state.zeros_factory(), state.notices(),
                        state.timeline())
        engine.configure(world_engine._stall_warn, world_engine._stall_shutdown)
    ps._engine = engine
    ps.process_set_id = state.next_set_id()
    state.add_set(ps)
    return ps


def _members(mpi_comm, world):
    """The global ranks of mpi_comm's members, as this rank sees them (none
    for MPI.COMM_NULL)."""

    if mpi_comm == MPI.COMM_NULL:
        return []
    group, world_group = mpi_comm.Get_group(), world.handle.mpi_comm.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                world_group))
    finally:
        group.Free()
        world_group.Free()


def add_process_set(process_set):
    """Registers a process set (a ProcessSet or a list of global ranks) and
    returns it. Collective: every rank calls it, in the same order. (Horovod
    needs HOROVOD_DYNAMIC_PROCESS_SETS=1 for this; gradsync always allows it.)"""
    state.check_initialized()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is registered already")
    return _register(process_set)


def remove_process_set(process_set):
    """Unregisters a process set: an operation of the global set (every rank
    calls it); then the set's operations still pending raise and its
    communicator is closed. Returns whether anything was removed; the
    global set is never removed."""
    if process_set.process_set_id in (None, 0) or not state.remove_set(process_set):
        return False
    world_engine = state.world_engine()
    try:
        world_engine.wait(world_engine.submit("remove_set", []))
    finally:
        process_set._invalidate()
    return True
