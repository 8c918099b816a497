# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""gradsync._core: the low-level binding. It mirrors the C API: it converts
and checks arguments, calls C with the GIL released, and turns status codes
into exceptions. gradsync/__init__.py builds the friendly classes on it."""

from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from cpython.mem cimport PyMem_Malloc, PyMem_Free
cimport numpy as cnp
import os
import sys
import threading
import numpy as np

from gradsync.gs_status cimport *
from gradsync.gs_types cimport *
from gradsync.gs_comm cimport *
from gradsync.gs_collectives cimport *
from gradsync.gs_shard cimport *
from gradsync.gs_info cimport *
from gradsync.gs_kernels cimport *
from gradsync.gs_device cimport *
from gradsync.gs_async cimport *
from gradsync.gs_p2p cimport *
from gradsync.gs_timeline cimport *
from gradsync.gs_flight cimport *
from gradsync.dlpack cimport *

cnp.import_array()

include "_errors.pxi"
include "_dtypes.pxi"
include "_dlpack.pxi"
include "_tensors.pxi"
include "_memory.pxi"
include "_device.pxi"
include "_kernels.pxi"
include "_async.pxi"
include "_flight.pxi"
include "_op_args.pxi"
include "_options.pxi"

gs_set_interrupt_check(check_signals)


def set_timeout(seconds):
    """Process-wide: a collective that waits longer than ``seconds`` raises
    gs.TimeoutError and leaves its communicator unusable (None or 0: wait
    forever). Default: GRADSYNC_TIMEOUT_SECONDS."""
    gs_set_timeout_seconds(0.0 if seconds is None else float(seconds))


def start_timeline(path):
    """Records every collective's phases on rank 0 into a Chrome trace at
    ``path`` (written by stop_timeline() or at exit)."""
    cdef bytes p = os.fsencode(path)
    CHKERR(gs_timeline_start(p))


def stop_timeline():
    """Writes the timeline file and stops recording (no-op when not recording)."""
    CHKERR(gs_timeline_stop())


def timeline_active():
    return bool(gs_timeline_active())


def version():
    return gs_version().decode()


def cuda_stream(int device):
    """CUDA device ``device``'s entry stream, as an int (a cudaStream_t):
    every later collective on that device, of every communicator, follows
    the work queued on it. No collective runs on it: each communicator has
    a stream of its own (``Communicator.cuda_stream``)."""
    cdef void *stream = NULL
    with nogil:
        CHKERR(gs_cuda_stream(device, &stream))
    return <uintptr_t>stream


def build_info_c():
    """What the compiled library reports about itself."""
    cdef int cuda_devices = 0
    cuda_error = None
    if gs_cuda_device_count(&cuda_devices) != GS_SUCCESS:
        cuda_devices = 0
        cuda_error = gs_last_error().decode(errors="replace")  # e.g. a driver too old
    return {
        "version": gs_version().decode(),
        "mpi_library_version": gs_mpi_library_version().decode(errors="replace").strip(),
        "mpi_library_path": gs_mpi_library_path().decode(errors="replace"),
        "mpi_thread_level": gs_mpi_thread_level(),
        "simd": gs_simd_level().decode(),
        "cuda_version": gs_cuda_version(),
        "nccl_version": gs_nccl_version(),
        "cuda_built": bool(gs_cuda_built()),
        "cuda_archs": gs_cuda_archs().decode(),
        "cuda_devices": cuda_devices,
        "cuda_error": cuda_error,
        "default_fusion_threshold": gs_default_fusion_threshold(),
        "check_payload_bytes": gs_check_payload_bytes(),
    }


def shard_layout(numels, int size):
    """(total, padded, rank_count, offsets, owners) of ONNX Runtime's layout."""
    cdef Py_ssize_t i, n = len(numels)
    cdef int64_t[::1] counts = np.asarray(numels, dtype=np.int64).reshape(-1).copy()
    cdef int64_t[::1] offsets = np.zeros(max(n, 1), dtype=np.int64)
    cdef int[::1] owners = np.zeros(max(n, 1), dtype=np.intc)
    cdef gs_shard_layout_t lay
    if counts.shape[0] != n:
        raise ArgumentError("numels must be a flat sequence of element counts",
                            GS_ERR_INVALID_ARGUMENT)
    CHKERR(gs_shard_layout(&counts[0] if n else NULL, n, size, &lay, &offsets[0], &owners[0]))
    return (lay.total, lay.padded, lay.rank_count,
            tuple(int(offsets[i]) for i in range(n)), tuple(int(owners[i]) for i in range(n)))


def block_range(int64_t rows, int size, int rank):
    """(first_row, nrows) of rank's block in reduce_scatter's balanced split."""
    cdef int64_t first, count
    CHKERR(gs_block_range(rows, 1, size, rank, &first, &count))
    return first, count


cdef class _CommHandle:
    """The C gs_comm_t a Comm holds and what every binding method needs of it
    (Comm's base: _CommExchange's methods, in _exchange.pxi, use it too)."""
    cdef gs_comm_t handle
    cdef public object mpi_comm
    cdef public object adasum  # default Adasum mode: None/"flat" or "hierarchical"
    cdef object converting     # an _Abandoning

    def __cinit__(self):
        self.handle = NULL
        guard = _Abandoning.__new__(_Abandoning)
        (<_Abandoning>guard).comm = <PyObject *>self
        self.converting = guard

    def __dealloc__(self):
        # gs_comm_free only frees the MPI communicator while MPI is alive;
        # it never waits on other ranks.
        if self.handle != NULL:
            gs_comm_free(&self.handle)

    cdef inline gs_comm_t live(self) except NULL:
        if self.handle == NULL:
            raise ClosedError("the communicator is closed", GS_ERR_CLOSED)
        if _flight_stacks:
            flight_mark()
        return self.handle

    cdef int abandon(self, exc) except -1:
        """Meet the other ranks' check on behalf of a call that failed here."""
        cdef bytes reason = str(exc).encode("utf-8", "replace")
        gs_comm_abandon(self.handle, status_of(exc), reason)
        return 0


include "_exchange.pxi"


cdef class Comm(_CommExchange):
    """Handle of a C gs_comm_t. Collective methods take lists of arrays."""

    @staticmethod
    def set_world(mpi_comm):
        """gs_comm_set_world: ranks in the flight record are ranks of
        ``mpi_comm`` (a world joined from singletons; it must outlive the
        communicators made on it)."""
        from mpi4py import MPI
        cdef uintptr_t addr = MPI._addressof(mpi_comm)
        CHKERR(gs_comm_set_world((<MPI_Comm *>addr)[0]))

    @staticmethod
    def create(mpi_comm, int64_t fusion_threshold=-1, int check=-1, double stall_seconds=-1):
        from mpi4py import MPI
        cdef Comm c = Comm.__new__(Comm)
        cdef gs_config_t cfg = GS_CONFIG_DEFAULT
        cdef uintptr_t addr = MPI._addressof(mpi_comm)
        cfg.fusion_threshold = fusion_threshold
        cfg.check = check
        cfg.stall_seconds = stall_seconds
        with nogil:
            CHKERR(gs_comm_create((<MPI_Comm *>addr)[0], &cfg, &c.handle))
        c.mpi_comm = mpi_comm
        return c

    def close(self):
        if self.handle != NULL:
            CHKERR(gs_comm_free(&self.handle))

    @property
    def closed(self):
        return self.handle == NULL

    def info(self):
        """(rank, size, local_rank, local_size, fusion_threshold, check)."""
        cdef int r, s, lr, ls, chk
        cdef int64_t thr
        cdef gs_comm_t h = self.live()
        CHKERR(gs_comm_rank(h, &r))
        CHKERR(gs_comm_size(h, &s))
        CHKERR(gs_comm_local_rank(h, &lr))
        CHKERR(gs_comm_local_size(h, &ls))
        CHKERR(gs_comm_fusion_threshold(h, &thr))
        CHKERR(gs_comm_check_enabled(h, &chk))
        return r, s, lr, ls, thr, bool(chk)

    def ride_bytes(self):
        """gs_comm_ride_bytes: the largest allreduce validated and reduced in one exchange."""
        cdef int64_t n
        CHKERR(gs_comm_ride_bytes(self.live(), &n))
        return n

    def stats(self):
        cdef gs_comm_stats_t st
        CHKERR(gs_comm_get_stats(self.live(), &st))
        return {"calls": st.calls, "validations": st.validations,
                "rode_in_check": st.rode_in_check, "messages": st.messages, "bytes": st.bytes,
                "hierarchical": st.hierarchical, "peer_reads": st.peer_reads,
                "hugepage_bytes": st.hugepage_bytes}

    def device_transport(self):
        cdef const char *name = NULL
        CHKERR(gs_comm_device_transport(self.live(), &name))
        return name.decode()

    def cuda_stream(self):
        """This communicator's own CUDA stream, as an int (a cudaStream_t):
        its collectives on CUDA memory run there. Made at its first such
        collective (ValueError before)."""
        cdef void *stream = NULL
        cdef gs_comm_t h = self.live()
        with nogil:
            CHKERR(gs_comm_cuda_stream(h, &stream))
        return <uintptr_t>stream

    def cuda_order_after(self, uintptr_t stream):
        """This communicator's later collectives follow the work queued so
        far on ``stream`` (a cudaStream_t as an int; 1: the legacy default
        stream, 2: the per-thread default stream)."""
        cdef gs_comm_t h = self.live()
        with nogil:
            CHKERR(gs_comm_cuda_order_after(h, stream))

    def set_fusion_threshold(self, int64_t nbytes):
        CHKERR(gs_comm_set_fusion_threshold(self.live(), nbytes))

    def set_timeout(self, double seconds):
        CHKERR(gs_comm_set_timeout(self.live(), seconds))

    def timeout(self):
        cdef double seconds = 0
        CHKERR(gs_comm_timeout(self.live(), &seconds))
        return seconds

    def split(self, int color, int key):
        cdef gs_comm_t h = self.live()
        cdef Comm c = Comm.__new__(Comm)
        with nogil:
            CHKERR(gs_comm_split(h, color, key, &c.handle))
        if c.handle == NULL:
            return None
        return c

    def barrier(self):
        cdef gs_comm_t h = self.live()
        with nogil:
            CHKERR(gs_barrier(h))

    # Each collective converts its arguments inside `with self.converting`:
    # a failure there meets the other ranks' check (abandon), so they raise
    # MismatchError instead of waiting, and the exception goes on up here.
    # Arguments are one array or a list/tuple of arrays (see arguments()).

    def allreduce(self, tensors, outputs, op="sum", double prescale=1.0,
                  double postscale=1.0, adasum=None, wire=None, residual=None):
        """outputs None: in place. wire: a wire format's name (None: the
        tensors' dtype); residual: float32 arrays like the tensors, or None."""
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop = GS_OP_SUM  # set inside `with`
        cdef gs_wire_t cwire = GS_WIRE_NONE
        cdef TensorList tin, tout = None, tres = None
        with self.converting:
            cwire = wire_of(wire, residual)
            cop = adasum_mode(parse_op(op), self.adasum if adasum is None else adasum)
            tin = arguments(tensors, "tensors", outputs is None, "comm.allreduce_")
            if outputs is not None:
                tout = arguments(outputs, "out", True, None, None, tin)
            tres = residual_arguments(residual, tin, "comm.allreduce_")
        cdef const gs_tensor_t *po = tout.t if tout is not None else NULL
        cdef const gs_tensor_t *pr = tres.t if tres is not None else NULL
        with nogil:
            if cwire == GS_WIRE_NONE:
                CHKERR(gs_allreduce(h, tin.t, po, tin.n, cop, prescale, postscale))
            else:
                CHKERR(gs_allreduce_wire(h, tin.t, po, tin.n, cop, prescale, postscale, cwire, pr))

    cpdef allreduce_inplace(self, tensors, op="sum", double prescale=1.0,
                            double postscale=1.0, adasum=None, wire=None, residual=None):
        """In-place allreduce that returns its argument. One ndarray or
        DeviceArray takes a path with no per-call allocation: small calls are
        latency bound."""
        cdef gs_comm_t h = self.live()
        cdef gs_tensor_t t
        cdef gs_op_t cop = GS_OP_SUM  # set inside `with`; gcc cannot tell it always is
        cdef bint device_array = type(tensors) is DeviceArray
        if (type(tensors) is not np.ndarray and not device_array) or wire is not None \
                or residual is not None:
            self.allreduce(tensors, None, op, prescale, postscale, adasum, wire, residual)
            return tensors
        # `with self.converting` as everywhere else, spelled out: here, on the
        # latency-bound path, its two method calls would cost 0.2 us a call.
        try:
            cop = parse_op(op)
            if cop == GS_OP_ADASUM:
                cop = adasum_mode(cop, self.adasum if adasum is None else adasum)
            if device_array:
                fill_ref(&t, <_TensorRef>tensors, "tensor", 0, False, True, "comm.allreduce_")
                if t.device.kind == GS_DEVICE_CUDA:  # not the stream an earlier call left
                    (<DeviceArray>tensors).call_on(LEGACY_STREAM)
            else:
                fill_tensor(&t, tensors, "tensor", 0, False, True, "comm.allreduce_")
        except BaseException as exc:
            self.abandon(exc)
            raise
        with nogil:
            CHKERR(gs_allreduce(h, &t, NULL, 1, cop, prescale, postscale))
        return tensors

    def broadcast(self, tensors, int root):
        cdef gs_comm_t h = self.live()
        cdef TensorList tl
        with self.converting:
            tl = arguments(tensors, "tensors", True, "comm.broadcast_")
        with nogil:
            CHKERR(gs_broadcast(h, tl.t, tl.n, root))

    def allgather_counts(self, tensors):
        """(shapes, counts): each tensor's shape once gathered over the ranks
        along dim 0, and gs_allgatherv's element counts (counts[r * n + i]),
        from gs_allgather_rows (rows of zero elements included)."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tin
        cdef Py_ssize_t i, n = 0  # (set in the block; GCC cannot tell)
        cdef int size = self.info()[1]
        cdef int64_t[::1] rows, row_elems, rows_out
        with self.converting:
            tin = arguments(tensors, "tensors", False)
            n = tin.n
            rows = np.zeros(max(n, 1), dtype=np.int64)
            row_elems = np.zeros(max(n, 1), dtype=np.int64)
            rows_out = np.zeros(max(n * size, 1), dtype=np.int64)
            for i in range(n):
                a = tin.arrays[i]
                if a.ndim == 0:
                    raise ArgumentError(f"{tin.label(i)} is 0-d; allgather concatenates along "
                                        "dim 0 and needs at least one dimension",
                                        GS_ERR_INVALID_ARGUMENT)
                rows[i] = a.shape[0]
                row_elems[i] = int(np.prod(a.shape[1:], dtype=np.int64))
        with nogil:
            CHKERR(gs_allgather_rows(h, tin.t, n, &rows[0], &row_elems[0], &rows_out[0]))
        gathered = np.asarray(rows_out)[:n * size].reshape(size, n) if n else None
        shapes = [(int(gathered[:, i].sum()),) + tin.arrays[i].shape[1:] for i in range(n)]
        counts = (gathered * np.asarray(row_elems)[:n]).reshape(-1) if n else np.zeros(1, np.int64)
        return shapes, counts

    # ---- asynchronous, in place: a Request; errors surface at wait() ----------
    cdef Request async_request(self, tensors, str call):
        """A Request holding the arrays of an in-place asynchronous call,
        converted and checked; the caller submits it."""
        cdef Request r
        with self.converting:
            r = new_request(arguments(tensors, "tensors", True, call), tensors)
        r.comm = self  # freed after its requests (pending() says why)
        return r

    cdef gs_op_t async_op(self, op, adasum) except *:
        with self.converting:
            return adasum_mode(parse_op(op), self.adasum if adasum is None else adasum)

    def allreduce_async(self, tensors, op, double prescale, double postscale, adasum,
                        wire=None, residual=None):
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop = self.async_op(op, adasum)
        cdef gs_wire_t cwire = GS_WIRE_NONE
        cdef TensorList tres = None
        cdef Request r = self.async_request(tensors, "comm.allreduce_async_")
        with self.converting:
            cwire = wire_of(wire, residual)
            tres = residual_arguments(residual, r.keep, "comm.allreduce_async_")
            r.keep_also = tres
        if cwire == GS_WIRE_NONE:
            CHKERR(gs_allreduce_async(h, r.keep.t, r.keep.n, cop, prescale, postscale, &r.req))
        else:
            CHKERR(gs_allreduce_wire_async(h, r.keep.t, r.keep.n, cop, prescale, postscale, cwire,
                                           tres.t if tres is not None else NULL, &r.req))
        return r

    def broadcast_async(self, tensors, int root):
        cdef gs_comm_t h = self.live()
        cdef Request r = self.async_request(tensors, "comm.broadcast_async_")
        CHKERR(gs_broadcast_async(h, r.keep.t, r.keep.n, root, &r.req))
        return r

    def allgather_shards_async(self, tensors):
        cdef gs_comm_t h = self.live()
        cdef Request r = self.async_request(tensors, "comm.allgather_shards_async_")
        CHKERR(gs_allgather_shards_async(h, r.keep.t, r.keep.n, &r.req))
        return r

    def reduce_scatter_shards_async(self, tensors, op, double prescale, double postscale):
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop = self.async_op(op, "flat")  # adasum is allreduce only: C refuses it
        cdef Request r = self.async_request(tensors, "comm.reduce_scatter_shards_async_")
        CHKERR(gs_reduce_scatter_shards_async(h, r.keep.t, r.keep.n, cop, prescale, postscale,
                                              &r.req))
        return r

    def allgather_shards(self, tensors):
        cdef gs_comm_t h = self.live()
        cdef TensorList tl
        with self.converting:
            tl = arguments(tensors, "tensors", True, "comm.allgather_shards_")
        with nogil:
            CHKERR(gs_allgather_shards(h, tl.t, tl.n))

    def reduce_scatter_shards(self, tensors, op, double prescale, double postscale):
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop
        cdef TensorList tl
        with self.converting:
            cop = parse_op(op)
            tl = arguments(tensors, "tensors", True, "comm.reduce_scatter_shards_")
        with nogil:
            CHKERR(gs_reduce_scatter_shards(h, tl.t, tl.n, cop, prescale, postscale))


cdef class CommunicatorBase:
    """The base of gradsync.Communicator: the methods on the latency-bound
    path, compiled, so a small in-place allreduce pays no Python frame
    (0.2 us of a 0.7 us call)."""
    cdef public Comm handle

    @property
    def c_handle(self):
        """The C communicator (a ``gs_comm_t``) as an int, for C, C++ and
        Cython code that calls gradsync's C API on this communicator: in
        Cython, ``<gs_comm_t><uintptr_t>comm.c_handle`` (docs/GUIDE.md,
        "Embedding gradsync"). Borrowed: valid until ``close()``, never to be
        freed by the caller; every rank makes the same collective calls on it
        in the same order, as through this object. ClosedError once closed."""
        cdef gs_comm_t h = self.handle.handle if self.handle is not None else NULL
        if h == NULL:
            raise ClosedError("the communicator is closed", GS_ERR_CLOSED)
        return <uintptr_t>h

    def allreduce_(self, tensors, op="sum", *, double prescale=1.0, double postscale=1.0,
                   adasum=None, wire=None, residual=None):
        """Reduces in place over ranks; returns what it was given. wire:
        "bfloat16", "float16", "float8_e4m3" or "float8_e5m2" sends the data
        in that format with float32 sums (docs/GUIDE.md); residual: error
        feedback (float32 arrays like the tensors, or a gradsync.ErrorFeedback)."""
        if residual is not None and hasattr(residual, "residuals"):
            residual = residual.residuals(tensors)
        return self.handle.allreduce_inplace(tensors, op, prescale, postscale, adasum, wire,
                                             residual)


cdef class _Abandoning:
    """The context manager behind Comm.converting: an exception inside it
    abandons the collective on the communicator's behalf and goes on up.
    Its Comm owns it and is alive whenever it is used: a borrowed pointer
    (a reference would be a cycle that only the garbage collector frees)."""
    cdef PyObject *comm

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            (<_CommHandle>self.comm).abandon(exc)
        return False
