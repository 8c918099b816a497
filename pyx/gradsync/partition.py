"""Partitions of workers and AllSumReduce, with DistDL's semantics.

A :class:`Partition` is a set of workers (ranks) with a Cartesian shape::

    P_world = gs.Partition(comm)
    P_base  = P_world.create_partition_inclusive(range(12))
    P_x     = P_base.create_cartesian_topology_partition([2, 2, 3])
    layer   = gs.AllSumReduce(P_x, axes_reduce=(1, 2))
    y  = layer(x)            # a new array, always
    dx = layer.adjoint(dy)   # the same operation: AllSumReduce is self-adjoint

Creating a partition or an AllSumReduce is collective over the ACTIVE workers
of the partition it starts from (they split its communicator). Inactive
workers communicate nothing: they may make the same call (SPMD code usually
does) and get an inactive result back, or skip it. Every reduction runs
through the C runtime (``Communicator.allreduce``, fused for a list).
"""
import itertools

import numpy as np
from mpi4py import MPI  # gradsync/__init__ loads it first, at gradsync's thread level

from gradsync import _core
from gradsync.communicator import Communicator

__all__ = ["AllSumReduce", "Partition", "zero_volume_array"]

_DL_HOST_DEVICES = (_core.DLPACK_CPU, _core.DLPACK_CUDA_HOST)


def zero_volume_array(dtype=np.float64):
    """An array with no elements (shape ``(0,)``) of ``dtype``: what workers
    outside a partition pass to its operations."""
    return np.empty((0,), dtype=dtype)


def _row_major(index, shape):
    """Linear row-major position of ``index`` in ``shape``."""
    lin = 0
    for i, n in zip(index, shape):
        lin = lin * n + i
    return lin


def _unravel(lin, shape):
    return tuple(int(i) for i in np.unravel_index(lin, shape)) if shape else ()


def _as_int(v, what):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return int(v)


class Partition:
    """A set of workers arranged in a Cartesian ``shape``.

    ``Partition(comm)`` holds every rank of ``comm`` (a gs.Communicator, or an
    mpi4py intracommunicator that is wrapped in one) as a one-dimensional
    partition. Attributes:

    - ``active``: whether this worker belongs to the partition;
    - ``rank``, ``size``: its rank in the partition and the partition's size
      (-1 on inactive workers);
    - ``shape`` (tuple), ``dim`` (``len(shape)``): kept on inactive workers;
    - ``index``: this worker's coordinates in ``shape``, row-major from
      ``rank`` (None on inactive workers);
    - ``comm``: the gs.Communicator of the partition's workers (None on
      inactive workers).
    """

    def __init__(self, comm=None, *, _shape=None, _inactive=False):
        self._groups = {}  # axes_reduce tuple -> group Communicator or None
        if _inactive:
            self.comm = None
            self.active = False
            self.rank = -1
            self.size = -1
            self.shape = tuple(_shape)
            self.dim = len(self.shape)
            self.index = None
            return
        if comm is None:
            raise TypeError("Partition(comm): comm is a gradsync.Communicator")
        if not isinstance(comm, Communicator):
            if not isinstance(comm, MPI.Intracomm):
                raise TypeError("Partition(comm): comm must be a gradsync.Communicator "
                                f"or an mpi4py intracommunicator, got {type(comm).__name__}")
            comm = Communicator(comm)
        self.comm = comm
        self.active = True
        self.rank = comm.rank
        self.size = comm.size
        self.shape = (comm.size,) if _shape is None else tuple(_shape)
        self.dim = len(self.shape)
        self.index = _unravel(self.rank, self.shape)

    @classmethod
    def _inactive(cls, shape):
        return cls(_shape=shape, _inactive=True)

    def __repr__(self):
        if not self.active:
            return f"<gradsync.Partition inactive shape={self.shape}>"
        return (f"<gradsync.Partition rank {self.rank} of {self.size} "
                f"shape={self.shape} index={self.index}>")

    # ---------------------------------------------------------------- creation
    def create_partition_inclusive(self, ranks):
        """A new one-dimensional partition of the workers whose ranks in this
        partition are ``ranks``, ordered as ``ranks`` lists them (worker
        ``ranks[i]`` gets rank i). Collective over this partition's active
        workers; the others get an inactive partition."""
        ranks = [_as_int(r, "a rank") for r in ranks]
        if len(ranks) == 0:
            raise ValueError("create_partition_inclusive: ranks is empty")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"create_partition_inclusive: repeated ranks in {ranks}")
        shape = (len(ranks),)
        if not self.active:
            return Partition._inactive(shape)
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(f"create_partition_inclusive: ranks {bad} are not in "
                             f"[0, {self.size})")
        if ranks == list(range(self.size)):
            return Partition(self.comm, _shape=shape)
        position = {r: i for i, r in enumerate(ranks)}
        mine = position.get(self.rank)
        sub = self.comm.split(-1 if mine is None else 0, 0 if mine is None else mine)
        if sub is None:
            return Partition._inactive(shape)
        return Partition(sub, _shape=shape)

    def create_cartesian_topology_partition(self, shape):
        """This partition's workers arranged in ``shape``, ranks mapped to
        indices in row-major order (as MPI_Cart_create without reordering).
        ``prod(shape)`` may be smaller than ``size``: the workers of rank
        ``prod(shape)`` and above are then inactive in the result (as
        MPI_Cart_create leaves them out); larger is a ValueError. Collective
        over this partition's active workers."""
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        shape = tuple(_as_int(n, "a partition extent") for n in shape)
        if len(shape) == 0 or any(n < 1 for n in shape):
            raise ValueError(f"create_cartesian_topology_partition: shape {shape} "
                             "must have at least one dimension, each >= 1")
        if not self.active:
            return Partition._inactive(shape)
        volume = int(np.prod(shape))
        if volume > self.size:
            raise ValueError(f"create_cartesian_topology_partition: shape {shape} "
                             f"needs {volume} workers, the partition has {self.size}")
        if volume == self.size:
            return Partition(self.comm, _shape=shape)
        inside = self.rank < volume
        sub = self.comm.split(0 if inside else -1, self.rank)
        if sub is None:
            return Partition._inactive(shape)
        return Partition(sub, _shape=shape)

    # ------------------------------------------------------------ reductions
    def _normalize_axes(self, axes_reduce, axes_keep):
        """(axes_reduce, axes_keep) as sorted tuples; ValueError for bad ones."""
        if (axes_reduce is None) == (axes_keep is None):
            raise ValueError("give exactly one of axes_reduce and axes_keep")
        given = axes_reduce if axes_keep is None else axes_keep
        name = "axes_reduce" if axes_keep is None else "axes_keep"
        if isinstance(given, (int, np.integer)):
            given = (given,)
        axes = [_as_int(a, f"an axis in {name}") for a in given]
        bad = [a for a in axes if not 0 <= a < self.dim]
        if bad:
            raise ValueError(f"{name}: axes {bad} are out of range for a partition "
                             f"of dimension {self.dim} (valid: 0 to {self.dim - 1})")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{name}: repeated axes in {tuple(axes)}")
        axes = tuple(sorted(axes))
        other = tuple(d for d in range(self.dim) if d not in axes)
        return (axes, other) if axes_keep is None else (other, axes)

    def _group_comm(self, axes_reduce):
        """The cached Communicator of this worker's reduction group over
        ``axes_reduce`` (None when the group has one member or the worker is
        inactive). Built on first request, collectively over the partition."""
        if axes_reduce in self._groups:
            return self._groups[axes_reduce]
        group = None
        if self.active:
            group_size = int(np.prod([self.shape[d] for d in axes_reduce]))
            if group_size == 1:
                group = None  # nothing to exchange: a copy
            elif group_size == self.size:
                group = self.comm  # every worker: the partition itself, in rank order
            else:
                keep = [d for d in range(self.dim) if d not in axes_reduce]
                color = _row_major([self.index[d] for d in keep],
                                   [self.shape[d] for d in keep])
                key = _row_major([self.index[d] for d in axes_reduce],
                                 [self.shape[d] for d in axes_reduce])
                group = self.comm.split(color, key)
        self._groups[axes_reduce] = group
        return group

    def reduction_groups(self, axes_reduce):
        """Every reduction group over ``axes_reduce`` as lists of partition
        ranks, members in row-major order of the reduced dimensions (local
        arithmetic, no communication)."""
        axes_reduce, keep = self._normalize_axes(axes_reduce, None)
        groups = []
        for kept in itertools.product(*[range(self.shape[d]) for d in keep]):
            members = []
            for red in itertools.product(*[range(self.shape[d]) for d in axes_reduce]):
                index = [0] * self.dim
                for d, i in zip(keep, kept):
                    index[d] = i
                for d, i in zip(axes_reduce, red):
                    index[d] = i
                members.append(_row_major(index, self.shape))
            groups.append(members)
        return groups


def _copy(a):
    """A new array with a's values: numpy for host memory, the object's own
    copy (``copy()``/``clone()``) for device memory."""
    if isinstance(a, np.ndarray):
        return a.copy()
    device = getattr(a, "__dlpack_device__", None)
    if device is not None and int(device()[0]) in _DL_HOST_DEVICES:
        return np.from_dlpack(a).copy()
    for name in ("copy", "clone"):
        f = getattr(a, name, None)
        if callable(f):
            return f()
    return np.array(a, copy=True)


class AllSumReduce:
    """Sum over the workers of a Cartesian partition that share their index
    in the kept dimensions (DistDL's AllSumReduce).

    ``AllSumReduce(P_x, axes_reduce=(1, 2))`` or, equivalently for a 3-d
    partition, ``axes_keep=(0,)``: exactly one of the two (ValueError
    otherwise, and for an axis outside ``[0, P_x.dim)`` or a repeated one).
    ``axes_reduce=()`` is allowed: the result is a copy.

    The reduction groups are the sub-communicators MPI_Cart_sub would build
    with the reduced dimensions remaining: members in row-major order of the
    reduced dimensions. They are built here, once per partition and axes
    (cached on the partition), by a split that is collective over the
    partition's active workers.

    ``layer(x)`` takes one array or a list of arrays (one fused message) and
    always returns new arrays. Inactive workers pass
    ``gs.zero_volume_array(dtype)`` and get a copy back. ``adjoint(dy)`` is
    the same operation.
    """

    def __init__(self, P_x, axes_reduce=None, axes_keep=None):
        if not isinstance(P_x, Partition):
            raise TypeError(f"AllSumReduce: P_x must be a gradsync.Partition, got "
                            f"{type(P_x).__name__}")
        self.P_x = P_x
        self.axes_reduce, self.axes_keep = P_x._normalize_axes(axes_reduce, axes_keep)
        #: the gs.Communicator of this worker's group; None when there is
        #: nothing to exchange (inactive worker, or a group of one)
        self.group = P_x._group_comm(self.axes_reduce)

    def __repr__(self):
        return (f"AllSumReduce(axes_reduce={self.axes_reduce}, "
                f"axes_keep={self.axes_keep}, P_x={self.P_x!r})")

    def __call__(self, x):
        was_list = isinstance(x, (list, tuple))
        if was_list and len(x) == 0:
            return []
        if self.group is None:
            return [_copy(a) for a in x] if was_list else _copy(x)
        return self.group.allreduce(list(x) if was_list else x, op="sum")

    forward = __call__

    def adjoint(self, dy):
        """The adjoint of the operation: the same sum (it is self-adjoint)."""
        return self(dy)
