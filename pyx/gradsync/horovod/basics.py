"""Horovod's basic API on gradsync: init/shutdown, the topology queries, the
build queries, the reduction ops, the timeline and the HOROVOD_* knobs."""
import atexit
import logging
import os

import gradsync as gs
from gradsync import MPI
from gradsync.horovod import state
from gradsync.horovod.engine import Engine
from gradsync.horovod.notices import Notices
from gradsync.horovod.process_sets import ProcessSet, _register, global_process_set
from gradsync.horovod.timeline import Timeline

log = logging.getLogger("gradsync.horovod")

# Horovod's values of its ReduceOp enum (scripts compare and store them)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max",
            Product: "prod"}

# HOROVOD_* variables that Horovod reads and gradsync has no use for: its
# collectives run when called (no cycle, no response cache, no autotuning,
# no stream or thread settings). Accepted, logged once, no effect.
NO_OP_KNOBS = (
    "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY", "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE",
    "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_MPI_THREADS_DISABLE",
    "HOROVOD_THREAD_AFFINITY", "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER",
    "HOROVOD_GPU_BROADCAST", "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER",
    "HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER", "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_TIMESTAMP",
    "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_NCCL_SINGLE_THREADED_BROADCAST")


def _env_float(name):
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def _knobs():
    """Communicator and engine settings from the HOROVOD_* knobs that change
    what gradsync does: HOROVOD_FUSION_THRESHOLD (bytes; 0, no fusion, is
    one tensor per message), HOROVOD_STALL_CHECK_TIME_SECONDS and
    HOROVOD_STALL_CHECK_DISABLE (gradsync's stall warning, and the warning
    for names some ranks submitted and others not), and
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (gradsync's timeout, and the time
    after which such a name shuts every rank down)."""
    settings, stalls = {}, {}
    fusion = _env_float("HOROVOD_FUSION_THRESHOLD")
    if fusion is not None:
        settings["fusion_threshold"] = max(1, int(fusion))
    stall = _env_float("HOROVOD_STALL_CHECK_TIME_SECONDS")
    if stall is not None:
        settings["stall_seconds"] = stalls["stall_warn"] = stall
    if os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("", "0"):
        settings["stall_seconds"] = stalls["stall_warn"] = 0.0
    shutdown = _env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    if shutdown:
        gs.set_timeout(shutdown)
        stalls["stall_shutdown"] = shutdown
    return settings, stalls


def _world_comm(comm, settings):

    if comm is None:  # gradsync's world: MPI's, or the one joined from singletons
        return gs.Communicator(**settings)
    if isinstance(comm, gs.Communicator):  # an elastic reset's new world (elastic.py)
        return comm
    if isinstance(comm, MPI.Comm):
        return gs.Communicator(comm, **settings)
    ranks = sorted(int(r) for r in comm)  # global ranks of MPI_COMM_WORLD
    me = MPI.COMM_WORLD.Get_rank()
    sub = MPI.COMM_WORLD.Split(0 if me in ranks else MPI.UNDEFINED, me)
    if sub == MPI.COMM_NULL:
        raise ValueError(f"hvd.init(comm={comm!r}): rank {me} of MPI_COMM_WORLD is not in comm")
    try:
        return gs.Communicator(sub, **settings)
    finally:
        sub.Free()


def _topology(comm):
    cross = comm.split(comm.local_rank, key=comm.rank)
    try:
        cross_rank, cross_size = cross.rank, cross.size
    finally:
        cross.close()
    import numpy as np

    sizes = np.array([comm.local_size, -comm.local_size], np.int64)
    comm.allreduce_(sizes, op="max")
    return {"rank": comm.rank, "size": comm.size, "local_rank": comm.local_rank,
            "local_size": comm.local_size, "cross_rank": cross_rank, "cross_size": cross_size,
            "homogeneous": bool(sizes[0] == -sizes[1])}


def init(comm=None, process_sets=None):
    """Starts gradsync.horovod: ``comm`` None (gradsync's world: MPI_COMM_WORLD,
    or the world joined from singletons under gradsyncrun --min-np or
    torchrun), a list of
    MPI_COMM_WORLD ranks, or an mpi4py communicator (duplicated);
    ``process_sets``: ProcessSets to register now, or "dynamic" (accepted:
    sets can always be added later). MPI itself is mpi4py's (initialized on
    import). Calling init() again while initialized does nothing (also after
    another rank shut down: this rank's collectives then raise)."""
    if state.initialized():
        return
    settings, stalls = _knobs()
    world = _world_comm(comm, settings)
    timeline = Timeline(writer=world.rank == 0)
    notices = Notices(world.split(0, key=world.rank))
    engine = Engine(world, range(world.size), state.zeros_factory(), notices, timeline)
    engine.configure(**stalls)
    state.start(engine, _topology(world), notices, timeline)
    global_process_set.ranks = list(range(world.size))
    global_process_set._engine = state.world_engine()
    global_process_set.process_set_id = state.next_set_id()
    state.add_set(global_process_set)
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path.upper() != "DYNAMIC":
        timeline.start(path, os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0")
                       not in ("", "0"))
    if world.rank == 0:
        unused = [k for k in NO_OP_KNOBS if k in os.environ]
        if unused:
            log.info("gradsync.horovod: %s have no effect on gradsync", ", ".join(unused))
    _register_atexit()
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets must hold ProcessSet objects, got {ps!r}")
            _register(ps)


_atexit_registered = False


def _register_atexit():
    """Horovod shuts down at exit: so do we (before mpi4py finalizes MPI),
    which tells the other ranks that this one is gone."""
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit():
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - nothing to raise to at exit
        log.warning("gradsync.horovod: shutdown at exit: %s", exc)


def shutdown(announce=True):
    """Shuts gradsync.horovod down on this rank and tells the other ranks,
    as Horovod does: operations still pending here and there raise
    HorovodInternalError (one already running gets a moment to finish).
    init() may be called again (on every rank). ``announce=False``: tell
    nobody (an elastic reset after a lost rank: no message goes to it)."""
    if not state.initialized():
        return
    world = state.world_engine()
    notices = state.notices()
    why = (f"Horovod has been shut down: rank {state.world_rank()} called shutdown() (or "
           "exited); collectives cannot complete without it")
    if notices is not None and announce:
        notices.announce(why)
    for ps in state.process_sets():
        if ps is not global_process_set:
            ps._invalidate(why)
    try:
        world.shutdown_local(why)
    finally:
        try:
            world.comm.close()
        except gs.Error:
            pass
        timeline = state.timeline()
        if timeline is not None:
            timeline.stop()
        global_process_set._engine = None
        global_process_set.process_set_id = 0
        state.stop()


def is_initialized():
    """True between init() and shutdown(), while no rank has shut down."""
    return state.initialized() and state.world_engine().closed is None
def size():
    """Number of processes."""
    return state.topology("size")


def rank():
    """This process's rank."""
    return state.topology("rank")


def local_size():
    """Processes on this node (MPI_Comm_split_type SHARED)."""
    return state.topology("local_size")


def local_rank():
    """This process's rank on its node."""
    return state.topology("local_rank")


def cross_size():
    """Nodes that have a process with this process's local rank."""
    return state.topology("cross_size")


def cross_rank():
    """This node's rank among the processes with this local rank."""
    return state.topology("cross_rank")


def is_homogeneous():
    """True when every node runs the same number of processes."""
    return state.topology("homogeneous")


def mpi_threads_supported():
    """True when MPI runs at MPI_THREAD_MULTIPLE (gradsync asks for
    SERIALIZED unless GRADSYNC_THREAD_LEVEL=multiple)."""

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled():
    """True: gradsync always runs on MPI."""
    return True


def mpi_built():
    """True: gradsync is always built with MPI."""
    return True


def gloo_enabled():
    """False: gradsync has no Gloo controller."""
    return False


def gloo_built():
    """False: gradsync has no Gloo controller."""
    return False


def nccl_built():
    """NCCL_VERSION_CODE of the NCCL gradsync was built with, as Horovod
    reports it (2.7.8: 2708; from 2.9: 10000 * major + 100 * minor + patch),
    or 0 without NCCL."""
    version = gs.build_info()["nccl"]
    if not version:
        return 0
    major, minor, patch = (int(x) for x in version.split(".")[:3])
    scale = 10000 if (major, minor) >= (2, 9) else 1000
    return major * scale + minor * 100 + patch


def cuda_built():
    """True when gradsync was built with CUDA."""
    return bool(gs.build_info()["cuda"])


def rocm_built():
    """False: gradsync has no ROCm build."""
    return False


def ddl_built():
    """False: no IBM DDL."""
    return False


def ccl_built():
    """False: no oneCCL."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Records Horovod's timeline (module gradsync.horovod.timeline) into
    ``file_path``, written by rank 0; ``mark_cycles`` adds CYCLE_START
    markers. Starting again with another path switches files."""
    state.check_initialized()
    state.timeline().start(file_path, mark_cycles)


def stop_timeline():
    """Closes the timeline's file (valid JSON)."""
    state.check_initialized()
    state.timeline().stop()
