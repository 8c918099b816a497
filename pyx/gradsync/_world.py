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

from gradsync import _core

# Environment variables an MPI launcher (Hydra, Open MPI, Slurm's PMI/PMIx)
# sets in its processes: with one of them the process is not a singleton.
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "PMIX_NAMESPACE",
                 "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
_POLL_SECONDS = 0.005
_WATCH_SECONDS = 0.05  # how often a join's waits ask whether a member is gone


_world = None          # the joined intracommunicator, or None: MPI_COMM_WORLD
_generation = 0        # joins started in this process: a retry uses fresh keys
_joined = None         # how _world was joined: (store, generation, rank, size, timeout)


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


class JoinError(_core.Error):
    """Joining singleton processes into one world failed (every rank raises it)."""


def _timeout():
    env = os.environ.get("GRADSYNC_TIMEOUT_SECONDS")
    return float(env) if env else 300.0


class _Rendezvous:
    """The store's side of one join: keys under ``gradsync/join/<gen>/``,
    every wait against one deadline, and an abort key that fails the others
    fast once one rank knows the join cannot finish."""

    def __init__(self, store, rank, size, timeout, generation, watch=None):
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.prefix = f"gradsync/join/{generation}/"
        self.watch = watch  # None, or a call naming a member that is gone (else None)
        self.watched = 0.0

    def key(self, name):
        return self.prefix + name

    def set(self, name, value):
        try:
            self.store.set(self.key(name), value)
        except Exception as e:  # noqa: BLE001 (the store is the user's: any error)
            raise JoinError(self._gone(e)) from e

    def _gone(self, e):
        return (f"gradsync join: rank {self.rank} of {self.size} lost the rendezvous store "
                f"({type(e).__name__}: {e}); is the store's host (MASTER_ADDR/MASTER_PORT, "
                "rank 0 or the torchrun agent) still up?")

    def _has(self, name):
        try:
            return self.store.check([self.key(name)])
        except Exception as e:  # noqa: BLE001
            raise JoinError(self._gone(e)) from e

    def get(self, name, waiting_for):
        """The value of ``name`` once set; JoinError at the deadline (naming
        ``waiting_for`` and the ranks that never arrived) or on an abort."""
        while True:
            if self._has("abort"):  # first: a port published before an abort is stale
                raise JoinError(bytes(self.store.get(self.key("abort"))).decode())
            if self._has(name):
                return bytes(self.store.get(self.key(name)))
            now = time.monotonic()
            if now > self.deadline:
                raise JoinError(self._late(waiting_for))
            if self.watch is not None and now - self.watched > _WATCH_SECONDS:
                self.watched = now
                gone = self.watch()
                if gone:  # the join cannot finish: say so to the others too
                    message = f"gradsync join: waiting for {waiting_for}: {gone}"
                    self.abort(message)
                    raise JoinError(message)
            time.sleep(_POLL_SECONDS)

    def same_size(self, peer):
        """JoinError when rank ``peer`` was told another WORLD_SIZE."""
        theirs = int(self.get(f"arrived/{peer}", f"rank {peer}'s arrival"))
        if theirs != self.size:
            raise JoinError(f"gradsync join: WORLD_SIZE differs between ranks: rank {self.rank} "
                            f"has {self.size}, rank {peer} has {theirs}; every process must be "
                            "given the same WORLD_SIZE")

    def claim(self):
        """Counts this rank's arrival under its number (the store's atomic
        add): a second claim of one number means two jobs share this
        rendezvous (one MASTER_ADDR/MASTER_PORT, or a store file left from an
        earlier run), and every rank of either job is told to fail rather
        than be joined to the other job's processes. A store without add
        (not torch's) skips the check."""
        add = getattr(self.store, "add", None)
        if add is None:
            return
        try:
            claims = int(add(self.key(f"claimed/{self.rank}"), 1))
        except Exception as e:  # noqa: BLE001
            raise JoinError(self._gone(e)) from e
        if claims != 1:
            message = (f"gradsync join: rank {self.rank} of WORLD_SIZE={self.size} arrived "
                       f"{claims} times at one rendezvous: two jobs (or a store left from an "
                       "earlier run) share one MASTER_ADDR/MASTER_PORT or store; give each job "
                       "its own port (or store file)")
            self.abort(message)
            raise JoinError(message)

    def missing(self):
        return [r for r in range(self.size) if not self._has(f"arrived/{r}")]

    def _late(self, waiting_for):
        try:
            missing = self.missing()
        except JoinError:
            missing = None
        said = self._sizes()
        msg = (f"gradsync join: rank {self.rank} waited {self.timeout:g} s "
               f"(GRADSYNC_TIMEOUT_SECONDS or the group's timeout) for {waiting_for}")
        if missing:
            msg += (f"; rank(s) {_ranges(missing)} of WORLD_SIZE={self.size} never arrived at "
                    "the rendezvous: are all processes started, with the same MASTER_ADDR/"
                    "MASTER_PORT (or store) and WORLD_SIZE?")
        if said and len(set(said.values())) > 1:
            msg += f"; the ranks disagree on WORLD_SIZE: {said}"
        return msg

    def _sizes(self):
        said = {}
        for r in range(self.size):
            try:
                if self._has(f"arrived/{r}"):
                    said[r] = int(self.store.get(self.key(f"arrived/{r}")))
            except (JoinError, ValueError):
                pass
        return said

    def abort(self, message):
        try:
            if not self._has("abort"):
                self.store.set(self.key("abort"), message.encode())
        except JoinError:
            pass


def _ranges(ranks):
    """[0, 1, 2, 5] as "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(out)


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
    _joined = (store, generation, rank, size, timeout)
    _core.Comm.set_world(comm)  # flight records name ranks of this world, not of a singleton's
    return comm


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
    MASTER_ADDR/MASTER_PORT) the joined world, ranked by ``rank`` (else
    RANK) of ``world_size`` (else WORLD_SIZE). Returns the mpi4py communicator."""
    if _world is not None:
        if (rank is not None and int(rank) != _world.Get_rank()) or (
                world_size is not None and int(world_size) != _world.Get_size()):
            raise ValueError(f"gradsync's world is already joined as rank {_world.Get_rank()} of "
                             f"{_world.Get_size()}, not rank {rank} of {world_size}")
        return _world
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
        if (size or 1) > 1:
            if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
                return init()
            if _slurm_step() is not None:
                raise _no_rendezvous(size)
    return world()
