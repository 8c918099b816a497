"""ProcessGroupGradsync: torch.distributed's collectives on a gs.Communicator.

Each method converts torch's arguments (tensor lists, options) into one
gradsync call on flat views of the tensors' memory. With ``opts.asyncOp``
False (``async_op=False``) the call runs on the calling thread and the Work
returned is already complete; otherwise it is queued on gradsync's
background thread and the Work completes later (DDP's reducer always takes
this path, so bucket allreduces overlap the backward pass). Ranks and roots
are the group's own, as torch passes them.

Timeouts: the group's (torch's ``timeout=``) becomes its communicator's own
wait limit, unless GRADSYNC_TIMEOUT_SECONDS is set; a blocking call's
``opts.timeout`` (``barrier(timeout=)``) replaces it for that call. A wait
that runs out raises ``_work.TimeoutError`` ("Timed out ...").
"""
import contextlib
import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.torch.distributed import _compile, _monitored, _sparse, _work
from gradsync.torch.distributed._rooted import RootedAndPointToPoint
from gradsync.torch.distributed._tensors import (
    Staged,
    cat,
    export,
    flat_view,
    numel_units,
    reduce_op,
    rows,
    scatter_into,
    unsupported,
)


def _is_async(opts):
    return getattr(opts, "asyncOp", True)


def _seconds(timeout):
    """A torch timeout (timedelta, or seconds) in seconds; None when unset
    (torch's kUnsetTimeout is negative)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return None if seconds < 0 else seconds


# torch's "no timeout of the call's own" (kUnsetTimeout), as options carry it
_UNSET_TIMEOUT = dist.AllreduceOptions().timeout
# What gradsync reduces in a tensor's own memory, without a stand-in (host
# bfloat16 goes through an ml_dtypes view: the general path)
_DIRECT_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                            torch.int32, torch.int64})


def _direct(t):
    """Whether gradsync takes tensor ``t`` as it is (no stand-in)."""
    return isinstance(t, torch.Tensor) and t.dtype in _DIRECT_DTYPES and \
        t.layout == torch.strided and t.is_contiguous()


def _direct_op(red):
    """gradsync's op for torch ReduceOp ``red`` on the direct path, or None
    (PREMUL_SUM, bitwise ops). SUM first: comparing is the cheapest read."""
    return "sum" if red == _SUM else _DIRECT_OPS.get(red.op.value)


def _bare(t):
    """``t`` as DLPack exports it (torch refuses tensors that require grad)."""
    return t.detach() if t.requires_grad else t


_SUM = dist.ReduceOp.SUM
_DIRECT_OPS = {dist.ReduceOp.RedOpType.SUM.value: "sum", dist.ReduceOp.RedOpType.AVG.value:
               "average", dist.ReduceOp.RedOpType.MIN.value: "min",
               dist.ReduceOp.RedOpType.MAX.value: "max",
               dist.ReduceOp.RedOpType.PRODUCT.value: "prod"}


class ProcessGroupGradsync(RootedAndPointToPoint, dist.ProcessGroup):
    """The "gradsync" backend of torch.distributed over ``comm``."""

    def __init__(self, comm, timeout=None):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._timeout = timeout
        self._name, self._desc = "", ""
        self._seq = 0  # collectives started: torch's sequence number for the group
        self._started = itertools.count(1)  # next() is atomic: no lock on the hot path
        self._free_tags = _monitored.tags(comm)[0]  # user tags below; monitored_barrier's above
        seconds = _seconds(timeout)
        if seconds and not os.environ.get("GRADSYNC_TIMEOUT_SECONDS"):
            comm.timeout = seconds

    def getBackendName(self):
        return "gradsync"

    @property
    def _device_types(self):
        """The devices this group serves (torch asks its registered backends,
        which a Python process group does not have): the CPU, and CUDA when
        there is a GPU."""
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available()
                                        else [])

    # torch keeps a group's name and description on its backends; a Python
    # process group is its own backend, so it keeps them itself
    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    def __repr__(self):
        return f"<ProcessGroupGradsync rank {self.comm.rank} of {self.comm.size}>"

    # ---- helpers ----------------------------------------------------------
    def _run(self, opts, blocking, asynchronous, result, finish=None, what="collective"):
        """Runs the blocking form now, or starts the asynchronous one."""
        self._count()
        if not _is_async(opts):
            with self._limit(_seconds(getattr(opts, "timeout", None)), what):
                blocking()
            return _work.done(result, finish)
        return _work.Work(asynchronous(), result, finish, what=what, limit=self.comm.timeout)

    def _count(self):
        self._seq = next(self._started)

    @contextlib.contextmanager
    def _limit(self, seconds, what):
        """Runs a blocking call under its own timeout ``seconds`` (None: the
        group's), given to that call alone as a call option of this thread
        (gs.call_options): the communicator, other threads and the calls
        already queued keep theirs. gradsync's timeouts leave in torch's
        words."""
        own = seconds is not None and seconds != _seconds(self._timeout)
        try:
            if own:
                with gs.call_options(timeout=max(seconds, 1e-6)):
                    yield
            else:
                yield
        except gs.TimeoutError as exc:
            raise _work.torch_error(exc, what, seconds if own else self.comm.timeout) from exc

    # ---- the direct path ----------------------------------------------------
    # The common calls (one dense tensor gradsync takes as it is, blocking,
    # under the group's timeout: dist.all_reduce(t), broadcast, barrier,
    # all_gather_into_tensor, reduce_scatter_tensor, as FSDP2 and metrics
    # make them) go straight to the communicator's blocking call and return
    # a finished Work (issue 46): no stand-ins, no Work machinery, no trip
    # through the background thread, a few microseconds more than the same
    # call on a gs.Communicator where the general path below cost 80.
    @staticmethod
    def _now(opts):
        return opts is not None and not opts.asyncOp and opts.timeout == _UNSET_TIMEOUT

    def _blocking(self, what, call, *args):
        self._count()
        try:
            call(*args)
        except gs.TimeoutError as exc:
            raise _work.torch_error(exc, what, self.comm.timeout) from exc

    # ---- sequence numbers (torch's desync checks read them) -----------------
    def _get_sequence_number_for_group(self):
        """Collectives started on this group so far: the same on every rank
        that made the same calls (point-to-point calls do not count)."""
        return self._seq

    def _set_sequence_number_for_group(self):
        """Every group starts at 0 on every rank: nothing to agree on."""

    # ---- allreduce ----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if self._now(opts) and len(tensors) == 1 and _direct(tensors[0]):
            op = _direct_op(opts.reduceOp)
            if op is not None:
                self._blocking("allreduce", self.comm.allreduce_, _bare(tensors[0]), op)
                return _work.finished(tensors)
        opts = opts or dist.AllreduceOptions()
        if any(isinstance(t, torch.Tensor) and t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        op, prescale = reduce_op(opts.reduceOp, "allreduce")
        staged = Staged(tensors, "tensors", True, op)
        views = staged.views
        return self._run(
            opts, lambda: self.comm.allreduce_(views, staged.op, prescale=prescale),
            lambda: self.comm.allreduce_async_(views, staged.op, prescale=prescale),
            tensors, staged.finish, "allreduce")

    def _sparse_allreduce(self, tensors, opts):
        """gloo's sparse allreduce: every rank's indices and values gathered,
        summed by coalescing (duplicates add), the sum copied into each
        tensor. Runs on the calling thread; the Work is complete."""
        kind = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
        if kind != dist.ReduceOp.RedOpType.SUM:
            raise NotImplementedError(f"gradsync backend: allreduce of sparse tensors supports "
                                      f"ReduceOp.SUM only (as gloo), got {kind.name}")
        if not all(isinstance(t, torch.Tensor) and t.is_sparse for t in tensors):
            raise ValueError("gradsync backend: allreduce's tensors must be all sparse or all "
                             "dense")
        local = tensors[0]
        for t in tensors[1:]:
            local = local + t
        self._count()
        with self._limit(_seconds(getattr(opts, "timeout", None)), "sparse allreduce"):
            total = _sparse.sparse_sum(self.comm, local.coalesce())
        for t in tensors:
            t.copy_(total)
        return _work.done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    # ---- broadcast ----------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if self._now(opts) and len(tensors) == 1 and _direct(tensors[0]):
            self._blocking("broadcast", self.comm.broadcast_, _bare(tensors[0]),
                           int(opts.rootRank))
            return _work.finished(tensors)
        opts = opts or dist.BroadcastOptions()
        staged = Staged(tensors, "tensors", True)
        root = int(opts.rootRank)
        return self._run(opts, lambda: self.comm.broadcast_(staged.views, root),
                         lambda: self.comm.broadcast_async_(staged.views, root),
                         tensors, staged.finish, "broadcast")

    # ---- allgather ----------------------------------------------------------
    def _allgather_flat(self, opts, inputs, outputs, result, finish=None):
        """inputs[i] (this rank's) gathered into outputs[i] (every rank's,
        equal sizes)."""
        staged_in = Staged(inputs, "input", False)
        staged_out = Staged(outputs, "output", True)

        def done():
            staged_out.finish()
            if finish is not None:
                finish()
        counts = [[numel_units(t)] * self.comm.size for t in inputs]
        counts = counts if len(inputs) > 1 else counts[0]
        ins = staged_in.views if len(inputs) > 1 else staged_in.views[0]
        outs = staged_out.views if len(inputs) > 1 else staged_out.views[0]
        return self._run(opts, lambda: self.comm.allgather_async(ins, outs, counts).wait(),
                         lambda: self.comm.allgather_async(ins, outs, counts), result, done,
                         "allgather")

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            unsupported("allgather of several tensors per rank (one per device)")
        inp, outs = input_tensors[0], output_tensors[0]
        if len(outs) != self.comm.size:
            raise ValueError(f"gradsync backend: allgather needs {self.comm.size} output "
                             f"tensors, got {len(outs)}")
        for o in outs:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError("gradsync backend: allgather's output tensors must have the "
                                 "input's size and dtype")
        flat = torch.empty(inp.numel() * self.comm.size, dtype=inp.dtype, device=inp.device)
        return self._allgather_flat(opts, [inp], [flat], output_tensors,
                                    lambda: scatter_into(flat_view(flat), outs))

    def _allgather_base(self, output, input, opts=None):
        if self._now(opts) and _direct(input) and _direct(output) and \
                output.dtype == input.dtype and output.numel() == input.numel() * self.comm.size:
            self._blocking("allgather", self.comm.handle.allgatherv, _bare(input),
                           output.detach().reshape(-1), [input.numel()] * self.comm.size, False)
            return _work.finished([output])
        return self._allgather_flat(opts or dist.AllgatherOptions(), [input], [output],
                                    [output])

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """output_lists[r][i] receives rank r's input_tensors[i]: one fused
        allgather of flat buffers, copied out."""
        opts = opts or dist.AllgatherOptions()
        P = self.comm.size
        if len(output_lists) != P or any(len(o) != len(input_tensors) for o in output_lists):
            raise ValueError(f"gradsync backend: allgather_coalesced needs {P} output lists "
                             f"of {len(input_tensors)} tensors")
        flats = [torch.empty(t.numel() * P, dtype=t.dtype, device=t.device)
                 for t in input_tensors]

        def finish():
            for i, flat in enumerate(flats):
                scatter_into(flat_view(flat), [output_lists[r][i] for r in range(P)])
        return self._allgather_flat(opts, list(input_tensors), flats, output_lists, finish)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._allgather_flat(opts or dist.AllgatherOptions(), list(inputs),
                                    list(outputs), list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # ---- reduce_scatter -------------------------------------------------------
    def _reduce_scatter_flat(self, opts, inputs, outputs, result, finish=None):
        op, prescale = reduce_op(opts.reduceOp, "reduce_scatter")
        staged_in = Staged(inputs, "input", False, op)
        staged_out = Staged(outputs, "output", True, op)
        for t_in, t_out in zip(inputs, outputs):
            if t_in.numel() != t_out.numel() * self.comm.size:
                raise ValueError(f"gradsync backend: reduce_scatter's input has "
                                 f"{t_in.numel()} elements; it needs {self.comm.size} times "
                                 f"the output's {t_out.numel()}")
        ins = [rows(v, self.comm.size) for v in staged_in.views]
        outs = staged_out.views

        def done():
            staged_out.finish()
            if finish is not None:
                finish()
        return self._run(
            opts, lambda: self.comm.reduce_scatter_async(ins, outs, staged_in.op,
                                                         prescale=prescale).wait(),
            lambda: self.comm.reduce_scatter_async(ins, outs, staged_in.op, prescale=prescale),
            result, done, "reduce_scatter")

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            unsupported("reduce_scatter of several tensors per rank (one per device)")
        out, ins = output_tensors[0], input_tensors[0]
        if len(ins) != self.comm.size:
            raise ValueError(f"gradsync backend: reduce_scatter needs {self.comm.size} input "
                             f"tensors, got {len(ins)}")
        if any(t.numel() != out.numel() for t in ins):
            unsupported("reduce_scatter with inputs of different sizes")
        flat = cat(ins)
        if flat.dtype != out.dtype:
            flat = flat.view(out.dtype)
        return self._reduce_scatter_flat(opts, [flat], [out], output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        if self._now(opts) and _direct(input) and _direct(output) and \
                output.dtype == input.dtype and input.numel() == output.numel() * self.comm.size:
            op = _direct_op(opts.reduceOp)
            if op is not None:
                self._blocking("reduce_scatter", self.comm.handle.reduce_scatter_into,
                               input.detach().reshape(-1), output.detach().reshape(-1),
                               [input.numel()], op, 1.0, 1.0, False)
                return _work.finished([output])
        return self._reduce_scatter_flat(opts or dist.ReduceScatterOptions(), [input],
                                         [output], [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_flat(opts or dist.ReduceScatterOptions(), list(inputs),
                                         list(outputs), list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- all-to-all -----------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        P = self.comm.size
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError("gradsync backend: all_to_all_single needs tensors with a dim 0")
        if not input.is_contiguous():  # as torch's backends refuse it
            raise ValueError("gradsync backend: all_to_all_single's input is not contiguous: "
                             "Tensors must be contiguous")
        send, recv = list(input_split_sizes), list(output_split_sizes)
        for name, t, splits in (("input", input, send), ("output", output, recv)):
            if not splits and t.shape[0] % P:
                raise ValueError(f"gradsync backend: all_to_all_single without "
                                 f"{name}_split_sizes needs {name}'s dim 0 ({t.shape[0]}) "
                                 f"divisible by {P}")
        send = send or [input.shape[0] // P] * P
        recv = recv or [output.shape[0] // P] * P
        # flat views: counts in their units (elements, or bytes for other dtypes)
        row_in = numel_units(input[0]) if input.shape[0] else 0
        row_out = numel_units(output[0]) if output.shape[0] else 0
        staged_out = Staged([output], "output", True)
        return self._a2a(opts, export(flat_view(input.contiguous())), staged_out.views[0],
                         [s * row_in for s in send], [r * row_out for r in recv], [output],
                         staged_out.finish)

    all_to_all_single = alltoall_base

    def _a2a(self, opts, inp, out, send, recv, result, finish):
        return self._run(opts, lambda: self.comm.alltoall_async(inp, out, send, recv).wait(),
                         lambda: self.comm.alltoall_async(inp, out, send, recv), result, finish,
                         "alltoall")

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        P = self.comm.size
        if len(input_tensors) != P or len(output_tensors) != P:
            raise ValueError(f"gradsync backend: all_to_all needs {P} input and {P} output "
                             "tensors")
        dtypes = {t.dtype for t in list(input_tensors) + list(output_tensors)}
        if len(dtypes) != 1:
            raise ValueError("gradsync backend: all_to_all's tensors must share one dtype")
        flat_in = cat(input_tensors)
        send = [numel_units(t) for t in input_tensors]
        recv = [numel_units(t) for t in output_tensors]
        flat_out = torch.empty(sum(recv), dtype=flat_in.dtype, device=flat_in.device)
        return self._a2a(opts, export(flat_in), export(flat_out), send, recv,
                         list(output_tensors),
                         lambda: scatter_into(flat_out, output_tensors))

    # ---- barrier ----------------------------------------------------------------
    def barrier(self, opts=None):
        if self._now(opts):
            self._blocking("barrier", self.comm.barrier)
            return _work.finished([])
        self._count()
        with self._limit(_seconds(getattr(opts, "timeout", None)), "barrier"):
            self.comm.barrier()  # also waits for the collectives queued before it
        return _work.done([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's monitored_barrier: group rank 0 waits ``timeout`` (None:
        the group's) for the others and raises naming the first rank that did
        not arrive (every such rank with ``wait_all_ranks``); the others wait
        for rank 0's answer for up to the group's timeout. See _monitored."""
        seconds = _seconds(timeout)
        group = _seconds(self._timeout)
        _monitored.monitored_barrier(self.comm, group if seconds is None else seconds,
                                     bool(wait_all_ranks), group)


# Collectives that run eagerly inside compiled regions (_compile.py says why).
COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
               "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
               "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall_base",
               "alltoall", "barrier", "monitored_barrier", "gather", "scatter", "reduce", "send",
               "recv", "recv_anysource")
_compile.eager_under_compile(ProcessGroupGradsync, COLLECTIVES)

