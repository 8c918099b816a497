"""Horovod's PyTorch collectives on gradsync: allreduce, allgather,
broadcast, alltoall and reducescatter with their async, in-place and grouped
forms, poll/synchronize, join and barrier.

Tensors go to gradsync zero-copy (DLPack). Horovod's arithmetic is kept:
Average is a sum followed by one multiply by postscale/size; integer tensors
are scaled in float64 and truncated (C++ double-to-int conversion), float16
and bfloat16 in float32, float32 in float32, float64 in float64. Every operation runs on the
process set's executor thread (gradsync.horovod.engine): submission returns
at once, poll() is False until it has run, and operations are matched across
ranks by name, as Horovod matches them.

Handles, poll() and synchronize() are in gradsync.horovod.torch.handles,
the op and scaling rules in .scaling, and what turns tensors into the
engine's arrays and call tags in .tensors.
"""
import torch

from gradsync.horovod import state
from gradsync.horovod.basics import OP_NAMES, Adasum, Average, Sum
from gradsync.horovod.errors import HorovodInternalError
from gradsync.horovod.process_sets import global_process_set
from gradsync.horovod.torch.compression import Compression
from gradsync.horovod.torch.handles import (  # noqa: F401 (poll: Horovod's mpi_ops has it)
    _done_handle,
    _handle,
    _Raise,
    poll,
    synchronize,
)
from gradsync.horovod.torch.scaling import _op, _scale_, _scales
from gradsync.horovod.torch.tensors import (
    _as_bytes,
    _contiguous,
    _from_bytes,
    _stream,
    _tag,
    _zeros_on,
)
from gradsync.torch._dlpack import _import


def _engine(process_set):
    state.check_initialized()
    return process_set.engine()


# ----------------------------------------------------------------- allreduce

def _allreduce_submit(tensors, name, op, prescale, postscale, process_set, result):
    """Reduces ``tensors`` (contiguous, detached) in place; ``result(tensors)``
    is what synchronize() returns. Returns the handle."""
    engine = _engine(process_set)
    if not tensors:
        return _done_handle(result([]))
    gs_op, pre, post, my_pre, my_post = _scales(tensors, op, prescale, postscale,
                                                process_set.size())
    _scale_(tensors, my_pre)
    adasum = None
    if op == Adasum:
        cuda = tensors[0].device.type == "cuda"
        adasum = "hierarchical" if cuda and engine.comm.local_size > 1 else "flat"

    def finish(arrays):
        _scale_(tensors, my_post)
        return result(tensors)
    call = engine.submit("allreduce", tensors, name=name, tag=_tag(tensors), op=gs_op,
                         prescale=pre, postscale=post, adasum=adasum, finish=finish,
                         context=_stream(tensors))
    return _handle(engine, call, name)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of ``tensor`` into a new tensor; returns a handle
    for poll()/synchronize(). op defaults to Average."""
    op = _op(op, average)
    out = _contiguous(tensor).clone()
    return _allreduce_submit([out], name, op, prescale_factor, postscale_factor, process_set,
                             lambda ts: ts[0])


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of ``tensor`` (contiguous); returns a handle."""
    op = _op(op, average)
    return _allreduce_submit([tensor.detach()], name, op, prescale_factor, postscale_factor,
                             process_set, lambda ts: tensor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """allreduce with its gradient: the same allreduce of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, average=average, op=op, prescale_factor=prescale,
                          postscale_factor=postscale, process_set=process_set),
                None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The allreduce of ``tensor`` over the process set, a new tensor
    (Average by default); differentiable; ``compression`` as Horovod's."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                 postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts one fused allreduce of a list into new tensors; returns a handle."""
    op = _op(op, average)
    outs = [_contiguous(t, f"tensors[{i}]").clone() for i, t in enumerate(tensors)]
    return _allreduce_submit(outs, name, op, prescale_factor, postscale_factor, process_set,
                             list)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Starts one fused in-place allreduce of a list; returns a handle."""
    op = _op(op, average)
    tensors = list(tensors)
    return _allreduce_submit([t.detach() for t in tensors], name, op, prescale_factor,
                             postscale_factor, process_set, lambda ts: tensors)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Fused in-place allreduce of a list; returns the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op,
                                                         prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set = ctx.args
        return (None,) * 6 + tuple(grouped_allreduce(
            list(grads), average=average, op=op, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """One fused allreduce of a list into new tensors; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                         process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Allreduce of a sparse tensor as Horovod does it: its indices and
    values allgathered, summed by coalescing (divided by the set size for
    Average). Returns a callable that gives the result."""
    t = tensor.coalesce()
    indices = allgather(t.indices().t().contiguous(),
                        None if name is None else f"{name}.indices", process_set)
    values = allgather(t.values().contiguous(),
                       None if name is None else f"{name}.values", process_set)

    def result():
        v = values / process_set.size() if op == Average else values
        return torch.sparse_coo_tensor(indices.t(), v, t.size(), check_invariants=True).coalesce()
    return result


# ----------------------------------------------------------------- allgather

def _allgather_submit(tensors, name, process_set, result):
    engine = _engine(process_set)
    wire = [_as_bytes(t) for t in tensors]

    def finish(outs):
        return result([_from_bytes(_import(o), t) for o, t in zip(outs, tensors)])
    call = engine.submit("allgather", wire, name=name,
                         tag=_tag(tensors, rows_may_differ=True), finish=finish,
                         context=_stream(tensors))
    return _handle(engine, call, name)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts the concatenation of ``tensor`` over the set along dim 0 (dim 0
    may differ by rank); returns a handle."""
    return _allgather_submit([_contiguous(tensor)], name, process_set, lambda outs: outs[0])


class HorovodAllgather(torch.autograd.Function):
    """allgather; gradient: the average of the output gradients over the
    set, this rank's rows of it (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        reduced = allreduce(grad, op=Average, process_set=ps)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ps)
        offset = int(rows[:ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenation of ``tensor`` over the set along dim 0; differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts one allgather of a list (each gathered on its own)."""
    return _allgather_submit([_contiguous(t, f"tensors[{i}]") for i, t in enumerate(tensors)],
                             name, process_set, list)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ps)
        rows = grouped_allgather([torch.tensor([r], dtype=torch.int64) for r in ctx.rows],
                                 process_set=ps)
        return (None, None) + tuple(g.narrow(0, int(r[:ps.rank()].sum()), n)
                                    for g, r, n in zip(reduced, rows, ctx.rows))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of every tensor of a list, in one call; differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ----------------------------------------------------------------- broadcast

def _broadcast_submit(tensor, root_rank, name, process_set, result):
    engine = _engine(process_set)
    root = process_set.root_index(root_rank)
    call = engine.submit("broadcast", [_as_bytes(tensor).reshape(-1)], name=name,
                         tag=_tag([tensor]), root=root, finish=lambda _: result,
                         context=_stream([tensor]))
    return _handle(engine, call, name)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of root's ``tensor`` into a new tensor (root_rank is
    a global rank); returns a handle."""
    out = _contiguous(tensor).clone()
    return _broadcast_submit(out, root_rank, name, process_set, out)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts an in-place broadcast from root_rank; returns a handle."""
    return _broadcast_submit(tensor.detach(), root_rank, name, process_set, tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """broadcast; gradient: the average of the output gradients on the root,
    zero elsewhere (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if state.world_rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root's ``tensor`` on every rank, a new tensor; differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ------------------------------------------------------------- reducescatter

def _reducescatter_submit(tensors, name, op, process_set, prescale, postscale, result):
    engine = _engine(process_set)
    if op not in (Average, Sum):
        return _done_handle(_Raise(HorovodInternalError(
            "Reducescatter currently only supports Average and Sum, not "
            f"{OP_NAMES.get(op, op)!r}")))
    gs_op, pre, post, my_pre, my_post = _scales(tensors, op, prescale, postscale,
                                                process_set.size())
    if my_pre != 1.0:
        tensors = [t.clone() for t in tensors]  # the input is not modified
        _scale_(tensors, my_pre)

    me, n = process_set.rank(), process_set.size()
    outs = [torch.empty((t.shape[0] // n + (me < t.shape[0] % n),) + tuple(t.shape[1:]),
                        dtype=t.dtype, device=t.device) if t.dim() else t.new_empty(0)
            for t in tensors]

    def finish(outs):
        _scale_(outs, my_post)
        return result(outs)
    call = engine.submit("reduce_scatter", tensors, name=name, tag=_tag(tensors), op=gs_op,
                         prescale=pre, postscale=post, out=outs, finish=finish,
                         context=_stream(tensors))
    return _handle(engine, call, name)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reduction over the set of which this rank keeps block
    ``rank`` of dim 0 (the first ``n % size`` ranks get one row more);
    Average or Sum. Returns a handle."""
    return _reducescatter_submit([_contiguous(tensor)], name, op, process_set, prescale_factor,
                                 postscale_factor, lambda outs: outs[0])


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        factor = (process_set.size() if op == Sum else 1) * prescale * postscale
        return (allgather(grad * factor if factor != 1 else grad, process_set=process_set),
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block of dim 0 of the reduction of ``tensor``; differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts one reducescatter of a list (each scattered on its own)."""
    return _reducescatter_submit([_contiguous(t, f"tensors[{i}]") for i, t in enumerate(tensors)],
                                 name, op, process_set, prescale_factor, postscale_factor, list)


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, process_set, prescale, postscale)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op,
                                                             process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, prescale, postscale = ctx.args
        factor = (process_set.size() if op == Sum else 1) * prescale * postscale
        grads = [g * factor for g in grads] if factor != 1 else list(grads)
        return (None,) * 5 + tuple(grouped_allgather(grads, process_set=process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of every tensor of a list, in one call; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ------------------------------------------------------------------- alltoall

def _splits(tensor, splits, set_size):
    """Rows sent to each member, checked as Horovod checks them."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or rows % set_size:
            raise ValueError(f"alltoall without splits divides dim 0 ({rows} rows) equally "
                             f"among {set_size} ranks: it must be a multiple of {set_size}")
        return [rows // set_size] * set_size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"splits must be a tensor of 32-bit integers, got {splits.dtype}")
        splits = splits.cpu().tolist()
    splits = [int(s) for s in splits]
    if len(splits) != set_size or any(s < 0 for s in splits):
        raise ValueError(f"splits must hold {set_size} non-negative counts, got {splits}")
    if sum(splits) > rows:
        raise ValueError(f"the splits add up to {sum(splits)} rows, more than the tensor's "
                         f"{rows}")
    return splits


def _alltoall_submit(tensor, splits, name, process_set, with_counts):
    engine = _engine(process_set)
    t = _contiguous(tensor)
    counts = _splits(t, splits, process_set.size())
    t = t.narrow(0, 0, sum(counts)) if t.dim() else t

    def finish(out):
        received, recv_counts = out
        received = _from_bytes(_import(received), t)
        recv = torch.tensor([int(c) for c in recv_counts], dtype=torch.int32)
        return (received, recv) if with_counts else received
    wire = _as_bytes(t)
    call = engine.submit("alltoall", [wire], name=name, send_counts=counts, finish=finish,
                         tag=_tag([t], rows_may_differ=True), context=_stream([t]))
    return _handle(engine, call, name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: ``splits[i]`` rows of dim 0 go to member i (equal
    shares without splits); returns a handle. synchronize() gives the
    received rows, and with ``splits`` also the rows received from each."""
    return _alltoall_submit(tensor, splits, name, process_set, splits is not None)


class HorovodAlltoall(torch.autograd.Function):
    """alltoall; gradient: alltoall of the output gradient back with the
    received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        received, recv = synchronize(_alltoall_submit(tensor, splits, name, process_set, True))
        ctx.recv, ctx.process_set = recv, process_set
        if splits is None:
            return received
        ctx.mark_non_differentiable(recv)
        return received, recv

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = alltoall(grad, splits=ctx.recv, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """alltoall (see alltoall_async); differentiable. Returns the received
    tensor, and with ``splits`` also the received row counts."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# --------------------------------------------------------------- join, barrier

def join(device=-1):
    """This rank has no more data: it takes part in the other ranks'
    allreduces with zeros (on ``device``: -1 CPU, else that CUDA device)
    until every rank has joined. Returns the rank that joined last, the
    same on every rank."""
    engine = _engine(global_process_set)
    state.set_zeros_factory(_zeros_on("cpu" if device < 0 else torch.device("cuda", device)))
    return engine.join()


def barrier(process_set=global_process_set):
    """Waits until every rank of the set has called it."""
    engine = _engine(process_set)
    engine.wait(engine.submit("barrier", []))


state.set_zeros_factory(_zeros_on("cpu"))
