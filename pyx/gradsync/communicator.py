"""The Communicator: fused collectives over lists of arrays."""
import numpy as np
from mpi4py import MPI  # gradsync/__init__ loads it first, at gradsync's thread level

from gradsync import _core, _grow, _shrink, _world
from gradsync._args import _answer, _as_list, _label, _row_shape
from gradsync.exchange import ExchangeCollectives

_ALL = object()
_default = None


def default_communicator(comm=None):
    """``comm``, else the one Communicator over gradsync's world (MPI_COMM_WORLD,
    or the world joined by gs.init / the torch backend) that gradsync's
    adapters (gradsync.torch, gradsync.jax) share, created on first use: a
    collective call, so every rank makes its first such call together."""
    global _default
    if comm is not None:
        return comm
    if _default is None or _default.closed:
        _default = Communicator()
    return _default


class Communicator(_core.CommunicatorBase, ExchangeCollectives):
    """A group of ranks that run collectives together.

    ``Communicator()`` duplicates gradsync's world: mpi4py's COMM_WORLD under
    mpiexec/srun, the joined world after ``gs.init`` or the torch backend's
    init, and, for MPI singletons whose environment names a torchrun-style
    rendezvous (RANK, WORLD_SIZE>1, MASTER_ADDR, MASTER_PORT), the world it
    joins then (docs/GUIDE.md, "Launching"); ``Communicator(comm)``
    duplicates any mpi4py intracommunicator. ``fusion_threshold`` (bytes)
    caps one fused message (default: GRADSYNC_FUSION_THRESHOLD, else 128 MiB);
    ``stall_seconds`` is how long a rank waits for the others before it warns
    (default: GRADSYNC_STALL_SECONDS, else 60; 0 turns the warning off).
    ``adasum`` ("flat" or "hierarchical") is how op="adasum" runs by default:
    hierarchical averages inside each node and runs Adasum across nodes
    (docs/GUIDE.md section 5, "Adasum guidance"); any call can say otherwise
    with its own ``adasum=``.
    Close it with ``close()`` or a ``with`` block; closing twice is harmless.
    """

    def __init__(self, mpi_comm=None, *, fusion_threshold=None, stall_seconds=None,
                 adasum="flat", _handle=None):
        if adasum not in ("flat", "hierarchical"):
            raise ValueError(f"adasum must be 'flat' or 'hierarchical', got {adasum!r}")
        if _handle is None:
            mpi_comm = _world.auto_world() if mpi_comm is None else mpi_comm
            if not isinstance(mpi_comm, MPI.Intracomm):
                raise TypeError("mpi_comm must be an mpi4py intracommunicator, got "
                                f"{type(mpi_comm).__name__}")
            threshold = -1 if fusion_threshold is None else int(fusion_threshold)
            if fusion_threshold is not None and threshold <= 0:
                raise ValueError(f"fusion_threshold must be positive, got {fusion_threshold}")
            stall = -1.0 if stall_seconds is None else float(stall_seconds)
            if stall_seconds is not None and stall < 0:
                raise ValueError(f"stall_seconds must be >= 0, got {stall_seconds}")
            _handle = _core.Comm.create(mpi_comm, threshold, -1, stall)
            self._stall_seconds = stall_seconds
        self.handle = _handle
        self.handle.adasum = adasum
        (self.rank, self.size, self.local_rank, self.local_size, _,
         self.check) = self.handle.info()
        # over gradsync's world itself (the one shrink() remakes): its ranks are the world's
        self._world_ranks = range(self.size) if mpi_comm is _world.world() else None

    # ---- life cycle -------------------------------------------------------
    def close(self):
        """Frees the communicator and its buffers. Later calls raise gs.Error."""
        self.handle.close()

    @property
    def closed(self):
        return self.handle.closed

    def shrink(self, lost=None):
        """A new Communicator over the ranks still alive, ranked in their old
        order, once one was lost (gs.PeerLostError); this one is closed.
        Collective over the survivors: every one calls it, and they agree on
        who is left (the same answer on each, even when another rank dies
        meanwhile). ``lost``: the PeerLostError caught, or the ranks it named
        (a hint; the survivors find the rest). The new one keeps this one's
        fusion threshold, stall warning, timeout and Adasum mode, and is
        gradsync's world from now on. Needs a world joined from singletons
        (torchrun, or gs.init with a store): elsewhere
        gs.UnsupportedError (docs/GUIDE.md, "Losing a rank")."""
        self._check_world_ranks("shrink")
        ranks = getattr(lost, "ranks", lost) or ()
        return self._remade(_shrink.shrink_world([self._world_ranks[r] for r in ranks]))

    def newcomers_waiting(self):
        """How many processes wait to join this world (gs.elastic.join_running):
        the most any rank has seen. Collective (one small allreduce)."""
        self._check_world_ranks("grow")
        return max(0, _grow.pending(self) - _world._admitted)

    def grow(self):
        """A new Communicator over this one's ranks and the processes waiting
        to join (gs.elastic.join_running), ranked after them in the order
        they came; this one is closed. This one when none waits. Collective
        over this communicator's ranks; the newcomers' side is
        join_running. Needs a world joined from singletons, as shrink."""
        self._check_world_ranks("grow")
        upto = _grow.pending(self)
        if upto <= _world._admitted:
            return self
        return self._remade(_grow.grow_world(upto))

    def _check_world_ranks(self, what):
        if self._world_ranks is None:
            raise _core.UnsupportedError(
                f"{what}: this communicator was made over an MPI communicator of the caller's "
                "(Communicator(mpi_comm)), not over gradsync's world")

    def _remade(self, world):
        """This communicator's successor over ``world``, with its settings;
        this one closed (abandoned when a loss broke it: its MPI
        communicators and buffers are kept, not freed)."""
        global _default
        threshold, timeout = self.fusion_threshold, self.timeout
        self.close()
        new = Communicator(world, fusion_threshold=threshold,
                           stall_seconds=getattr(self, "_stall_seconds", None),
                           adasum=self.handle.adasum)
        new.timeout = timeout
        if _default is self:  # the adapters' shared one follows
            _default = new
        return new

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"rank {self.rank} of {self.size}"
        return f"<gradsync.Communicator {state}>"

    @property
    def fusion_threshold(self):
        """Bytes per fused message; every rank must use the same value."""
        return self.handle.info()[4]

    @fusion_threshold.setter
    def fusion_threshold(self, nbytes):
        self.handle.set_fusion_threshold(int(nbytes))

    @property
    def ride_bytes(self):
        """The largest allreduce (bytes of one dtype, within the fusion
        threshold) validated and reduced in one exchange: 128 bytes through
        MPI; with every rank on one host, a slot of the host's shared region
        (``GRADSYNC_SHM_BYTES``, about 1 MiB), which needs no MPI at all."""
        return self.handle.ride_bytes()

    @property
    def timeout(self):
        """This communicator's own wait limit in seconds, or None: then the
        process-wide one applies (gs.set_timeout, GRADSYNC_TIMEOUT_SECONDS).
        A collective, receive or device wait on it that waits longer raises
        gs.TimeoutError and leaves it unusable. Local to this rank; a wait
        takes the value it finds when it begins."""
        seconds = self.handle.timeout()
        return seconds if seconds > 0 else None

    @timeout.setter
    def timeout(self, seconds):
        if seconds is not None and not float(seconds) > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got "
                             f"{seconds!r}")
        self.handle.set_timeout(0.0 if seconds is None else float(seconds))

    @property
    def device_transport(self):
        """What this communicator's collectives on CUDA memory go through,
        chosen by all ranks together at its first such call: "nccl",
        "mpi-cuda-aware", "mpi-staged" (MPI through pinned host memory), or
        "none" before that call."""
        return self.handle.device_transport()

    @property
    def cuda_stream(self):
        """This communicator's own CUDA stream, as an int (a cudaStream_t),
        once its first collective on CUDA memory has run (None before): its
        collectives run there, each after the caller's stream. Every
        communicator has its own, so threads driving different communicators
        never queue behind each other's collectives."""
        if self.device_transport == "none":
            return None
        return self.handle.cuda_stream()

    def cuda_order_after(self, stream):
        """Makes this communicator's later collectives follow the work queued
        so far on ``stream`` (a cudaStream_t as an int, or an object with a
        ``cuda_stream`` attribute, such as a torch or CuPy stream)."""
        self.handle.cuda_order_after(int(getattr(stream, "cuda_stream", stream)))

    def stats(self):
        """Counts since creation, on this rank: ``calls`` (collectives),
        ``validations`` (cross-rank checks), ``rode_in_check`` (small allreduces
        done inside their check), ``messages`` (data messages: one per fused
        message), ``bytes`` (in those messages) and ``hierarchical`` (of those
        messages, allreduces made host by host: docs/CLUSTER.md)."""
        return self.handle.stats()

    def split(self, color, key=0):
        """Ranks with equal color form a new Communicator, ordered by (key, rank).
        A negative color returns None on that rank."""
        handle = self.handle.split(int(color), int(key))
        return None if handle is None else Communicator(_handle=handle, adasum=self.handle.adasum)

    def barrier(self):
        """Waits for every rank (validated like a collective)."""
        self.handle.barrier()

    # ---- collectives ------------------------------------------------------
    # allreduce_ (in place) is CommunicatorBase's, compiled: see _core.pyx.

    def allreduce(self, tensors, op="sum", *, prescale=1.0, postscale=1.0, adasum=None,
                  wire=None, residual=None):
        """Reduces over ranks into new arrays; the inputs are not changed.
        wire and residual as for allreduce_."""
        arrays, was_list = _as_list(tensors)
        outs = self._checked(lambda: _new_like(arrays, was_list, copy=False))
        if residual is not None and hasattr(residual, "residuals"):
            residual = residual.residuals(tensors)
        self.handle.allreduce(tensors, _answer(outs, was_list), op, prescale, postscale, adasum,
                              wire, residual)
        return _answer(outs, was_list)

    # ---- asynchronous (in place): return a gs.Request --------------------------
    def allreduce_async_(self, tensors, op="sum", *, prescale=1.0, postscale=1.0,
                         adasum=None, wire=None, residual=None):
        """Starts an in-place allreduce and returns at once: a Request whose
        ``wait()`` returns ``tensors`` once reduced (``test()``, ``done``). The
        collectives run in issue order on the runtime's background thread; a
        blocking collective waits for them first. Don't touch the tensors (or
        the residuals) until the request is done. wire and residual as for
        allreduce_."""
        if residual is not None and hasattr(residual, "residuals"):
            residual = residual.residuals(tensors)
        return self.handle.allreduce_async(tensors, op, prescale, postscale, adasum, wire,
                                           residual)

    def broadcast_async_(self, tensors, root=0):
        """Starts an in-place broadcast from ``root``; returns a Request."""
        return self.handle.broadcast_async(tensors, int(root))

    def allgather_shards_async_(self, tensors):
        """Starts allgather_shards_; returns a Request."""
        return self.handle.allgather_shards_async(tensors)

    def reduce_scatter_shards_async_(self, tensors, op="sum", *, prescale=1.0, postscale=1.0):
        """Starts reduce_scatter_shards_; returns a Request."""
        return self.handle.reduce_scatter_shards_async(tensors, op, prescale, postscale)

    def broadcast_(self, tensors, root=0):
        """Every rank's tensors take root's values, in place."""
        self.handle.broadcast(tensors, int(root))
        return tensors

    def broadcast(self, tensors, root=0):
        """New arrays holding root's values (inputs unchanged)."""
        arrays, was_list = _as_list(tensors)
        outs = self._checked(lambda: _new_like(arrays, was_list, copy=True))
        self.handle.broadcast(_answer(outs, was_list), int(root))
        return _answer(outs, was_list)

    def allgather(self, tensors):
        """Concatenation over ranks along dim 0 (dim 0 may differ by rank);
        each array of a list is gathered on its own."""
        return self._allgather(tensors, _core.empty_like)

    def _allgather(self, tensors, alloc):
        """allgather with outputs from ``alloc(input, shape)``."""
        arrays, was_list = _as_list(tensors)
        shapes, counts = self.handle.allgather_counts(tensors)
        outs = self._checked(lambda: [alloc(a, s) for a, s in zip(arrays, shapes)])
        self.handle.allgatherv(tensors, _answer(outs, was_list), counts, False)
        return _answer(outs, was_list)

    def reduce_scatter(self, tensors, op="sum", *, prescale=1.0, postscale=1.0):
        """Block `rank` of dim 0 of the reduction, with the balanced split
        n // size + (rank < n % size) rows."""
        return self._reduce_scatter(tensors, op, prescale, postscale, _core.empty_like)

    def _reduce_scatter(self, tensors, op, prescale, postscale, alloc):
        """reduce_scatter with outputs from ``alloc(input, shape)``."""
        arrays, was_list = _as_list(tensors)

        def prepare():
            rows, outs = [], []
            for i, (a, (shape, _)) in enumerate(zip(arrays, _core.describe(tensors))):
                where = _label("tensors", i, True) if was_list else "tensor"
                rows.append(_row_shape(shape, where, "reduce_scatter")[0])
                nrows = _core.block_range(shape[0], self.size, self.rank)[1]
                outs.append(alloc(a, (nrows,) + shape[1:]))
            return rows, outs
        rows, outs = self._checked(prepare)
        self.handle.reduce_scatter_into(tensors, _answer(outs, was_list), rows, op,
                                  float(prescale), float(postscale), False)
        return _answer(outs, was_list)

    def allgather_shards_(self, tensors):
        """ZeRO allgather: every tensor takes its owner's values (ShardLayout)."""
        self.handle.allgather_shards(tensors)
        return tensors

    def reduce_scatter_shards_(self, tensors, op="sum", *, prescale=1.0, postscale=1.0):
        """ZeRO reduce_scatter: tensors this rank owns become the reduction;
        the others are left exactly as they were."""
        self.handle.reduce_scatter_shards(tensors, op, prescale, postscale)
        return tensors


def _new_like(arrays, was_list, copy):
    """New arrays shaped and typed like ``arrays``, each in its kind of memory
    (numpy.ndarray for host memory, a DeviceArray on the same CUDA device),
    holding their values with ``copy``."""
    if all(type(a) is np.ndarray for a in arrays):
        return [np.array(a, copy=True) if copy else np.empty_like(a) for a in arrays]
    outs = []
    for view in _core.views(_answer(arrays, was_list)):  # each producer read once
        out = _core.empty_like(view, view.shape)
        outs.append(_core.copy_(out, view) if copy else out)
    return outs
