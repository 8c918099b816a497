"""gradsync's world: the one MPI intracommunicator that ``Communicator()``,
the adapters and the torch backend start from.

Under an MPI launcher (mpiexec, srun) it is MPI_COMM_WORLD. When the
processes are MPI singletons (each started on its own, by torchrun, torch's
spawn harness, a Kubernetes or Slurm wrapper around torchrun) and a rendezvous
store is given, ``join`` makes them one intracommunicator with MPI's
dynamic-process calls: aligned blocks of 2^k ranks merge pairwise (the even
block's first rank opens a port and accepts, the odd block's first rank
connects; the port name travels through the store), so N ranks take
ceil(log2 N) rounds and come out ranked as the launcher ranked them.

Every wait here is a poll of the store against one deadline (the timeout),
and every failure is told to the group (a broadcast) and to the other groups
(an abort key), so each rank raises naming what is missing instead of
waiting in MPI_Comm_accept for a peer that will not come.
"""
import os
import socket
import time

from mpi4py import MPI  # gradsync/__init__ loads it first, at gradsync's thread level

from gradsync import _core, _members
from gradsync._filestore import FileStore
from gradsync._rendezvous import BoundedStore, JoinError, _Rendezvous

# Environment variables an MPI launcher (Hydra, Open MPI, Slurm's PMI/PMIx)
# sets in its processes: with one of them the process is not a singleton.
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "PMIX_NAMESPACE",
                 "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")

_world = None          # the joined intracommunicator, or None: MPI_COMM_WORLD
_generation = 0        # joins started in this process: a retry uses fresh keys
_joined = None         # how _world was joined: (store, generation, rank, size, timeout)
_admitted = 0          # newcomers' tickets admitted into this world so far (_grow)


def mpi_launched():
    """Whether an MPI launcher started this process (its world is MPI's)."""
    return MPI.COMM_WORLD.Get_size() > 1 or any(v in os.environ for v in LAUNCHER_VARS)


def world():
    """The mpi4py intracommunicator behind gradsync's world: the joined one
    after ``join`` (``gs.init``), else MPI_COMM_WORLD."""
    return MPI.COMM_WORLD if _world is None else _world


def joined():
    """Whether gradsync's world was joined from singletons."""
    return _world is not None


def _timeout():
    env = os.environ.get("GRADSYNC_TIMEOUT_SECONDS")
    return float(env) if env else 300.0


def check_can_join():
    """Raises UnsupportedError for an MPI known to fail connect/accept
    between singletons, naming it and the fix (docs/decisions/launch.md)."""
    version = MPI.Get_library_version().strip().splitlines()
    first = version[0] if version else "?"
    if first.startswith("MPICH Version:") and first.split(":", 1)[1].strip().startswith("5.0"):
        raise _core.UnsupportedError(
            f"gradsync join: {first.split(':', 1)[1].strip()} (MPICH) cannot connect singleton "
            "processes (MPI_Comm_connect/accept fail with 'Local and remote groups ... must not "
            "overlap', MPICH issue 7805). Use MPICH 4.x: `python -m pip install "
            "'mpich>=4.3,<5'` (what `make deps` installs; then `make clean all`), or launch "
            "with mpiexec/srun instead of torchrun")


def _leader_step(rdv, comm, work, name):
    """Runs ``work()`` (which returns str) on comm's rank 0 and shares its
    result, or its failure, with the whole group through the store (key
    ``name``): every member returns or raises together, and a member waits
    in the store, where the join's watch sees a lost leader, not in MPI."""
    if comm.Get_rank() != 0:
        return rdv.get(name, f"the leader of ranks {rdv.rank - comm.Get_rank()}..").decode()
    error = None
    try:
        result = work()
    except JoinError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 (an MPI or store error: told to the group)
        error = f"gradsync join: rank {rdv.rank}: {type(e).__name__}: {e}"
    if error is not None:
        rdv.abort(error)  # the group's get() raises it
        raise JoinError(error)
    if comm.Get_size() > 1:
        rdv.set(name, result.encode())
    return result


def _merge_round(rdv, comm, k):
    """One round: this rank's block of 2^k ranks (``comm``) merges with its
    partner block; returns the merged intracommunicator, or None when the
    block has no partner this round."""
    rank, size = rdv.rank, rdv.size
    block = rank >> k
    partner = block ^ 1
    if partner << k >= size:
        return None
    acceptor = block % 2 == 0
    name = f"round/{k}/{block if acceptor else partner}"
    lead, peer = block << k, partner << k
    port = None
    try:
        if acceptor:
            def publish_and_wait():
                opened = MPI.Open_port()
                try:
                    rdv.set(name + "/port", opened.encode())
                    rdv.get(name + "/ready", f"rank {peer} to join ranks {lead}.. in round {k}")
                    rdv.same_size(peer)
                except BaseException:
                    MPI.Close_port(opened)  # no one will connect: closed here
                    raise
                return opened
            port = _leader_step(rdv, comm, publish_and_wait, name + "/accepting")
            inter = comm.Accept(port if comm.Get_rank() == 0 else None, root=0)
        else:
            def fetch():
                opened = rdv.get(name + "/port", f"rank {peer}'s port in round {k}").decode()
                rdv.same_size(peer)
                # said last, just before MPI_Comm_connect: the acceptor enters
                # MPI_Comm_accept (which no timeout ends) only now, so a rank
                # lost during a shrink's join leaves it blocked only if it
                # dies within the connect itself
                rdv.set(name + "/ready", b"1")
                return opened
            port_name = _leader_step(rdv, comm, fetch, name + "/connecting")
            inter = comm.Connect(port_name if comm.Get_rank() == 0 else None, root=0)
    except MPI.Exception as e:
        library = MPI.Get_library_version().strip().splitlines()[0]
        message = (f"gradsync join: MPI_Comm_{'accept' if acceptor else 'connect'} failed in "
                   f"round {k} between ranks {lead} and {peer} ({library}): {e}")
        rdv.abort(message)
        raise JoinError(message) from e
    finally:
        if port is not None and comm.Get_rank() == 0:
            MPI.Close_port(port)
    try:
        return inter.Merge(high=not acceptor)
    finally:
        inter.Disconnect()


def join(store, rank, size, timeout=None, *, generation=None, watch=None):
    """Joins ``size`` singleton processes into one intracommunicator through
    ``store`` (a torch.distributed.Store, or any object with set, get and
    check as torch's have); returns it, ranked as ``rank`` says. Collective:
    every rank calls it. JoinError names what was missing when it fails.
    ``generation`` names the join's keys in the store (default: a count of
    this process's joins); ``watch``, called while a wait lasts, names a
    member that is gone (the join then fails at once, not at the timeout)."""
    global _world, _generation, _joined
    rank, size = int(rank), int(size)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    check_can_join()
    timeout = _timeout() if timeout is None else float(timeout)
    _generation += 1
    generation = _generation if generation is None else generation
    rdv = _Rendezvous(store, rank, size, timeout, generation, watch)
    rdv.claim()
    # where this process lives, for a later shrink to tell a lost member
    # from a slow one (_shrink.py)
    rdv.set(f"proc/{rank}", f"{socket.gethostname()} {os.getpid()}".encode())
    rdv.set(f"arrived/{rank}", str(size).encode())
    comm = MPI.COMM_SELF.Dup()
    try:
        k = 0
        while (1 << k) < size:
            merged = _merge_round(rdv, comm, k)
            if merged is not None:
                comm.Free()
                comm = merged
            k += 1
        if (comm.Get_rank(), comm.Get_size()) != (rank, size):
            raise JoinError(f"gradsync join: rank {rank} of {size} came out rank "
                            f"{comm.Get_rank()} of {comm.Get_size()}")
        # from the store, not an MPI allgather: a member lost now ends a
        # wait in the store (the watch), where MPI would wait for ever
        sizes = [int(rdv.get(f"arrived/{r}", f"rank {r}'s arrival")) for r in range(size)]
        if len(set(sizes)) > 1:
            raise JoinError(f"gradsync join: the ranks disagree on WORLD_SIZE: {sizes}")
    except BaseException:
        comm.Free()
        raise
    _world = comm
    if not isinstance(store, BoundedStore):  # shrink and grow use it while training
        store = BoundedStore(store, timeout)
    _joined = (store, generation, rank, size, timeout)
    _core.Comm.set_world(comm)  # flight records name ranks of this world, not of a singleton's
    return comm


def join_running(store, timeout=None):
    """Joins the world the processes at ``store`` train in (a replacement,
    more capacity): takes a ticket (the store's add), says where it lives,
    waits until its members admit it at a step boundary (_grow, at each
    commit inside gradsync.elastic.run), then joins with them; returns
    gradsync's world. JoinError when nobody admits it within ``timeout``."""
    global _admitted
    if _world is not None:
        raise ValueError("this process is in a world already (gs.init or a join)")
    if not callable(getattr(store, "add", None)):
        raise _core.UnsupportedError(
            f"joining a running world needs a rendezvous store with add (torch's TCPStore and "
            f"FileStore, gradsync's GRADSYNC_STORE_DIR have it); {type(store).__name__} has not")
    timeout = _timeout() if timeout is None else float(timeout)
    ticket = int(store.add(_members.TICKETS, 1))
    store.set(f"gradsync/grow/want/{ticket}", f"{socket.gethostname()} {os.getpid()}".encode())
    key, deadline = f"gradsync/grow/admit/{ticket}", time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise JoinError(f"gradsync grow: ticket {ticket} waited {timeout:g} s and no member "
                            "admitted it: are the members training in gradsync.elastic.run "
                            "(which admits newcomers at each commit)?")
        time.sleep(0.005)
    generation, rank, size, first, upto, old_generation, old_size = (
        bytes(store.get(key)).decode().split())
    everyone = _members.of_world(store, old_generation, int(old_size)) + _members.newcomers(
        store, int(first), int(upto), timeout)
    _admitted = int(upto)
    try:
        return join(store, int(rank), int(size), timeout, generation=generation,
                    watch=_members.watch(everyone, range(len(everyone))))
    finally:
        for m in everyone:
            m.close()


def env_store(rank, size, timeout):
    """A torch TCPStore at MASTER_ADDR/MASTER_PORT, made as torch's env://
    rendezvous makes it: a client of torchrun's agent store (a new one for
    every restart), else hosted by rank 0, multi-tenant, so torch's own
    rendezvous later in this process shares that server."""
    try:
        from datetime import timedelta

        import torch.distributed as dist
    except ImportError as e:
        raise _core.UnsupportedError(
            "gradsync join from MASTER_ADDR/MASTER_PORT needs torch's TCPStore (install torch), "
            "or pass store= to gs.init") from e
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                         is_master=(rank == 0 and not agent), timeout=timedelta(seconds=timeout),
                         wait_for_workers=False, multi_tenant=not agent)


def _env_int(var):
    value = os.environ.get(var)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {value!r}") from None


def _slurm_step():
    """(task id, tasks) of an srun step of several tasks, else None.
    SLURM_STEP_NUM_TASKS is srun's, not the batch script's: a script run
    directly in an allocation is one process."""
    tasks = _env_int("SLURM_STEP_NUM_TASKS")
    task = _env_int("SLURM_PROCID")
    return (task, tasks) if tasks is not None and tasks > 1 and task is not None else None


def _singleton_numbering(rank, world_size):
    """The rank and size a launcher of singletons gave this process:
    arguments, else torch's RANK and WORLD_SIZE, else an srun step's task
    id and count (srun without PMI starts MPI singletons too)."""
    rank = _env_int("RANK") if rank is None else int(rank)
    world_size = _env_int("WORLD_SIZE") if world_size is None else int(world_size)
    step = None if mpi_launched() else _slurm_step()
    if step is not None:
        rank = step[0] if rank is None else rank
        world_size = step[1] if world_size is None else world_size
    return rank, world_size


def _no_rendezvous(world_size):
    if _slurm_step() is not None:
        return ValueError(
            f"gradsync: srun started {world_size} tasks (SLURM_STEP_NUM_TASKS) but gave MPI no "
            "PMI, so each is an MPI world of 1 (srun --mpi=none, or this Slurm's MpiDefault): "
            "launch with srun --mpi=pmi2 (MPICH; srun --mpi=list shows what this Slurm offers) or "
            "--mpi=pmix (Open MPI), or set MASTER_ADDR and MASTER_PORT and gradsync joins the "
            "tasks itself")
    return ValueError("gradsync join: WORLD_SIZE>1 but no rendezvous: set MASTER_ADDR and "
                      "MASTER_PORT (torchrun does), pass store=, or launch with mpiexec")


def init(store=None, *, rank=None, world_size=None, timeout=None):
    """gradsync's world for this process, made once: under an MPI launcher
    MPI_COMM_WORLD; for MPI singletons with a rendezvous (``store``, else
    GRADSYNC_STORE_DIR's folder, else MASTER_ADDR/MASTER_PORT) the joined
    world, ranked by ``rank`` (else RANK) of ``world_size`` (else
    WORLD_SIZE); with GRADSYNC_JOIN_RUNNING=1 (gradsyncrun's replacements)
    the running world at the store, joined as a newcomer (join_running).
    Returns the mpi4py communicator."""
    if _world is not None:
        if (rank is not None and int(rank) != _world.Get_rank()) or (
                world_size is not None and int(world_size) != _world.Get_size()):
            raise ValueError(f"gradsync's world is already joined as rank {_world.Get_rank()} of "
                             f"{_world.Get_size()}, not rank {rank} of {world_size}")
        return _world
    store = _dir_store() if store is None and not mpi_launched() else store
    if store is not None and os.environ.get("GRADSYNC_JOIN_RUNNING") == "1":
        return join_running(store, timeout)  # a newcomer (gradsyncrun's replacement)
    rank, world_size = _singleton_numbering(rank, world_size)
    if mpi_launched() or (world_size in (None, 1) and store is None):
        _check_mpi_world(rank, world_size)
        return MPI.COMM_WORLD
    if world_size is None or rank is None:
        raise ValueError("gradsync join: this process is an MPI singleton (no mpiexec/srun): "
                         "give rank= and world_size= (or RANK and WORLD_SIZE) with the store")
    if world_size == 1:
        return MPI.COMM_WORLD
    if store is None:
        if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
            raise _no_rendezvous(world_size)
        store = env_store(rank, world_size, _timeout() if timeout is None else timeout)
    return join(store, rank, world_size, timeout)


def _dir_store():
    """GRADSYNC_STORE_DIR's folder store (gradsyncrun's elastic mode), or None."""
    path = os.environ.get("GRADSYNC_STORE_DIR")
    return FileStore(path) if path else None


def _check_mpi_world(rank, size):
    w = MPI.COMM_WORLD
    for var, given, mpi_value in (("rank", rank, w.Get_rank()), ("world_size", size,
                                                                 w.Get_size())):
        if given is not None and given != mpi_value:
            raise ValueError(f"gradsync: {var}={given} but MPI says {mpi_value} (an MPI launcher "
                             "started this process; its numbering is the world's)")


def auto_world():
    """The world for a plain ``Communicator()``: the joined one when the
    environment describes a launch of singletons (torchrun's RANK,
    WORLD_SIZE>1, MASTER_ADDR, MASTER_PORT; or an srun step's tasks with
    MASTER_ADDR and MASTER_PORT), else MPI's. An srun step of several tasks
    without PMI and without a rendezvous raises: each task alone would be
    a world of 1 and train on its own."""
    if _world is None and not mpi_launched():
        _rank, size = _singleton_numbering(None, None)
        if os.environ.get("GRADSYNC_JOIN_RUNNING") == "1" and _dir_store() is not None:
            return init()
        if (size or 1) > 1:
            if (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")) or \
                    _dir_store() is not None:
                return init()
            if _slurm_step() is not None:
                raise _no_rendezvous(size)
    return world()
