"""gradsync as a torch.distributed backend.

Importing this module registers the backend "gradsync" for CPU and CUDA
tensors, so existing training code changes only the backend name::

    import torch.distributed as dist
    import gradsync.torch.distributed          # registers "gradsync"

    dist.init_process_group("gradsync")       # under mpiexec: rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)

Under ``mpiexec`` no MASTER_ADDR/MASTER_PORT, store or other environment is
needed: when the environment names no master, the ``env://`` rendezvous
(torch's default) takes rank and world size from MPI instead
(``init_method="gradsync://"`` asks for that explicitly); with MASTER_ADDR/
MASTER_PORT set, RANK and WORLD_SIZE default to MPI's. Processes that are MPI
singletons (torchrun, torch's spawn harness, mp.spawn) are joined into one MPI
world through the store torch's rendezvous made (env://, tcp://, file:// or
store=): gradsync._world, docs/TORCH_BACKEND.md "Launching".

``dist.new_group(ranks)`` and ``dist.new_subgroups`` get gradsync
communicators over exactly those ranks (MPI_Comm_create_group, which only the
members call, as torch calls the backend only on them). What the backend
cannot do raises NotImplementedError naming it. See docs/TORCH_BACKEND.md.
"""
import functools
import importlib
import os
import zlib
from datetime import timedelta

import torch.distributed as dist

import gradsync as gs
from gradsync import _world
from gradsync.torch.distributed._backend import ProcessGroupGradsync

__all__ = ["ProcessGroupGradsync", "BACKEND", "mpi_launched", "init", "remake_default_group"]

BACKEND = "gradsync"
# the module (torch.distributed.rendezvous is also the name of a function)
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
_MASTER_VARS = ("MASTER_ADDR", "MASTER_PORT")


def mpi_launched():
    """Whether this process runs under an MPI launcher (its world is MPI's)."""
    return _world.mpi_launched()


class _NoStore(dist.Store):
    """What the MPI rendezvous hands torch in place of a store: gradsync needs
    none, so nothing is stored, and anything that tries to use it (a gloo or
    NCCL group created on the side) is told what to do instead of waiting."""

    def __init__(self, timeout):
        super().__init__()
        self._timeout = timeout

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(
            "gradsync's MPI rendezvous has no store: another backend (gloo, nccl) needs "
            "one. Set MASTER_ADDR and MASTER_PORT (torch's env:// rendezvous then creates "
            "a TCP store that gradsync accepts and ignores), or pass store= to "
            "init_process_group")

    set = get = add = compare_set = wait = check = delete_key = num_keys = _refuse
    multi_get = multi_set = append = queue_push = queue_pop = queue_len = _refuse

    def set_timeout(self, timeout):
        self._timeout = timeout

    @property
    def timeout(self):
        return self._timeout


def _mpi_numbering():
    """gradsync's world's rank and size: a joined world's (gs.init, and after
    a shrink or a grow, when RANK/WORLD_SIZE tell of the launch, not of the
    world as it is now), else MPI's, with which RANK/WORLD_SIZE, when set,
    must agree."""
    if _world.joined():
        return _world.world().Get_rank(), _world.world().Get_size()
    rank, size = gs.MPI.COMM_WORLD.Get_rank(), gs.MPI.COMM_WORLD.Get_size()
    for var, mpi_value in (("RANK", rank), ("WORLD_SIZE", size)):
        given = os.environ.get(var)
        if given not in (None, "") and int(given) != mpi_value:
            raise ValueError(f"gradsync rendezvous: {var}={given} in the environment but MPI "
                             f"says {mpi_value}; unset it, or launch with mpiexec only")
    return rank, size


def _mpi_rendezvous(url, timeout=timedelta(minutes=30), **kwargs):
    """Rank and world size from MPI; checked against RANK/WORLD_SIZE when set."""
    rank, size = _mpi_numbering()
    yield _NoStore(timeout), rank, size
    raise RuntimeError("gradsync rendezvous: cannot re-rendezvous")


def _with_mpi_numbering(url):
    """env:// under an MPI launcher with MASTER_ADDR/MASTER_PORT set: the
    rank and world size torch's rendezvous reads come from MPI when RANK or
    WORLD_SIZE is unset (checked against MPI when set)."""
    rank, size = _mpi_numbering()
    query = [q for q in ([url.split("?", 1)[1]] if "?" in url else []) if q]
    if "rank=" not in url:
        query.append(f"rank={rank}")
    if "world_size=" not in url:
        query.append(f"world_size={size}")
    return url.split("?", 1)[0] + "?" + "&".join(query)


def _env_or_mpi(torch_env):
    def handler(url, timeout=timedelta(minutes=30), **kwargs):
        if not mpi_launched():
            return torch_env(url, timeout=timeout, **kwargs)
        if all(os.environ.get(v) for v in _MASTER_VARS):
            return torch_env(_with_mpi_numbering(url), timeout=timeout, **kwargs)
        return _mpi_rendezvous(url, timeout=timeout, **kwargs)
    handler.gradsync_wraps = torch_env
    return handler


def _install_rendezvous():
    handlers = _rendezvous._rendezvous_handlers  # no replace in torch: docs/decisions/torch.md
    if not hasattr(handlers["env"], "gradsync_wraps"):
        handlers["env"] = _env_or_mpi(handlers["env"])
    if "gradsync" not in handlers:
        _rendezvous.register_rendezvous_handler("gradsync", _mpi_rendezvous)


def _group_comm(ranks, group_id):
    """A Communicator over exactly `ranks` of gradsync's world, ranked in the order
    torch lists them (``new_group(sort_ranks=False)`` keeps the caller's
    order: group rank i is global rank ranks[i]); only they call this."""
    world = _world.world()
    group = world.Get_group().Incl(list(ranks))
    tag = zlib.crc32(str(group_id).encode()) % 16384  # the same on every member
    sub = world.Create_group(group, tag)
    group.Free()
    try:
        return gs.Communicator(sub)
    finally:
        sub.Free()


def _timeout_seconds(timeout):
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def _default_world(backend_opts):
    """The world group's MPI communicator: MPI_COMM_WORLD under an MPI
    launcher (torch's numbering must be MPI's), else the singletons joined
    through the store torch hands the backend (env://, tcp://, file://,
    store=), with torch's ranks."""
    rank, size = backend_opts.group_rank, backend_opts.group_size
    world = gs.MPI.COMM_WORLD
    if mpi_launched() or size == 1 or (_world.joined() and (rank, size) == (
            _world.world().Get_rank(), _world.world().Get_size())):
        world = _world.world()
        if (size, rank) != (world.Get_size(), world.Get_rank()):
            raise RuntimeError(
                f"gradsync backend: torch says rank {rank} of {size}, MPI says rank "
                f"{world.Get_rank()} of {world.Get_size()}: under mpiexec/srun torch's rank and "
                "world size must be MPI's (unset RANK and WORLD_SIZE, gradsync fills them in)")
        return world
    if _world.joined():
        raise RuntimeError(
            f"gradsync backend: torch says rank {rank} of {size}, but gradsync's world is "
            f"already joined as rank {_world.world().Get_rank()} of "
            f"{_world.world().Get_size()} in this process")
    seconds = None if os.environ.get("GRADSYNC_TIMEOUT_SECONDS") else _timeout_seconds(
        backend_opts.timeout)
    return _world.join(backend_opts.store, rank, size, seconds)


def _create(backend_opts, pg_options=None):
    """torch's extended-API creator: the world group, or a subgroup."""
    ranks = list(backend_opts.global_ranks_in_group)
    if not ranks:  # the default group
        comm = gs.Communicator(_default_world(backend_opts))
        seconds = _timeout_seconds(backend_opts.timeout)
        if seconds and not os.environ.get("GRADSYNC_TIMEOUT_SECONDS"):
            gs.set_timeout(seconds)  # the process group's timeout, as gloo and NCCL use theirs
    else:
        comm = _group_comm(ranks, backend_opts.group_id)
    return ProcessGroupGradsync(comm, backend_opts.timeout)


def _install_monitored_barrier():
    """torch's dist.monitored_barrier refuses every backend but gloo before
    it asks the group; a gradsync group is asked here instead. Code that
    bound the function before this import keeps torch's."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    torch_barrier = c10d.monitored_barrier
    if hasattr(torch_barrier, "gradsync_wraps"):
        return

    @functools.wraps(torch_barrier)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = c10d._get_default_group() if group is None and dist.is_initialized() else group
        if isinstance(pg, ProcessGroupGradsync) and not c10d._rank_not_in_group(group):
            return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return torch_barrier(group, timeout, wait_all_ranks)
    monitored_barrier.gradsync_wraps = torch_barrier
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


def _local_numbering(world):
    """This process's rank and the process count on its node in ``world``."""
    node = world.Split_type(gs.MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def init(**kwargs):
    """torch's default process group on gradsync, created once: the one call
    frameworks that pick their own backend accept (docs/TORCH_BACKEND.md,
    "Frameworks").

    accelerate, the HF Trainer, DeepSpeed and others create the default group
    only when none exists, with a backend of their choosing (accelerate turns
    every CPU backend but "mpi" into "gloo"); called before them, ``init()``
    makes the group they then find and use. Idempotent: when a default group
    already exists it is returned as it is if it is gradsync's, and a
    RuntimeError names its backend otherwise (nothing can switch an existing
    group). Returns the default group (``dist.group.WORLD``).

    Rank and world size come from the launcher: torchrun's RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT, or, under mpiexec/srun, MPI's (as
    ``init_process_group("gradsync")`` does, see "Starting"). A process that no
    launcher started (plain ``python train.py``) gets a world of one. Under an
    MPI launcher the variables frameworks read to learn they are distributed
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), when unset, are set to
    MPI's numbering; set ones are left alone (RANK and WORLD_SIZE must agree
    with MPI). ``kwargs`` go to ``dist.init_process_group`` (``timeout=``,
    ``init_method=``, ``store=``, ``rank=``, ``world_size=``).
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != BACKEND:
            raise RuntimeError(
                f"gradsync.torch.distributed.init(): the default process group already exists "
                f"on {backend!r}; call init() before anything creates one (a framework's "
                f"Trainer, Accelerator, Strategy or initialize()), or destroy that group first")
        return dist.group.WORLD
    explicit = any(k in kwargs for k in ("init_method", "store"))
    if mpi_launched():
        rank, size = _mpi_numbering()
        local_rank, local_size = _local_numbering(gs.MPI.COMM_WORLD)
        for var, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                           ("LOCAL_WORLD_SIZE", local_size)):
            if not os.environ.get(var):
                os.environ[var] = str(value)
    elif not explicit and not all(os.environ.get(v) for v in _MASTER_VARS + (
            "RANK", "WORLD_SIZE")):
        kwargs["init_method"] = "gradsync://"  # no launcher: a world of one
    dist.init_process_group(BACKEND, **kwargs)
    return dist.group.WORLD


def remake_default_group(**kwargs):
    """torch's default process group again, over gradsync's world as it is
    now: after ``Communicator.shrink()`` or ``grow()`` (in gradsync.elastic's
    ``on_change``), before rebuilding DDP or FSDP on it. Destroys the old
    group (a broken one's communicator is abandoned, not waited on);
    ``kwargs`` go to ``dist.init_process_group`` (``timeout=``). Returns the
    new default group."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(BACKEND, init_method="gradsync://", **kwargs)
    return dist.group.WORLD


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    _install_rendezvous()
    _install_monitored_barrier()


_register()
