"""The gradsync backend's rooted collectives (gather, scatter, reduce) and
point-to-point calls, as a base class of ProcessGroupGradsync: each converts
torch's arguments into one gradsync call on flat views, run by the group's
``_run`` (blocking or asynchronous, as torch asked)."""
import torch
import torch.distributed as dist

from gradsync.torch.distributed import _work
from gradsync.torch.distributed._tensors import (
    Staged,
    cat,
    export,
    flat_view,
    numel_units,
    reduce_op,
    scatter_into,
    unsupported,
)


class RootedAndPointToPoint:
    """gather, scatter, reduce, send, recv and recv_anysource; the subclass
    provides ``comm``, ``_run`` and ``_free_tags``."""

    # ---- rooted -------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        if len(input_tensors) != 1:
            unsupported("gather of several tensors per rank")
        root, P = int(opts.rootRank), self.comm.size
        inp = input_tensors[0]
        flat_in = flat_view(inp.contiguous())
        flat_out, finish = None, None
        outs = output_tensors[0] if output_tensors else []
        if self.comm.rank == root:
            if len(outs) != P:
                raise ValueError(f"gradsync backend: gather needs {P} output tensors at the "
                                 f"root, got {len(outs)}")
            flat_out = torch.empty(sum(numel_units(t) for t in outs), dtype=flat_in.dtype,
                                   device=inp.device)

            def finish():
                scatter_into(flat_out, outs)
        counts = [flat_in.numel()] * P
        out = None if flat_out is None else export(flat_out)
        return self._run(
            opts, lambda: self.comm.gather_async(export(flat_in), out, root, counts).wait(),
            lambda: self.comm.gather_async(export(flat_in), out, root, counts),
            list(outs), finish, "gather")

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        if len(output_tensors) != 1:
            unsupported("scatter of several tensors per rank")
        root, P = int(opts.rootRank), self.comm.size
        out = output_tensors[0]
        staged_out = Staged([out], "output", True)
        flat_in = None
        if self.comm.rank == root:
            ins = input_tensors[0] if input_tensors else []
            if len(ins) != P:
                raise ValueError(f"gradsync backend: scatter needs {P} input tensors at the "
                                 f"root, got {len(ins)}")
            flat_in = export(cat(ins))
        counts = [numel_units(out)] * P
        view = staged_out.views[0]
        return self._run(
            opts, lambda: self.comm.scatter_async(flat_in, view, root, counts).wait(),
            lambda: self.comm.scatter_async(flat_in, view, root, counts),
            [out], staged_out.finish, "scatter")

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op, prescale = reduce_op(opts.reduceOp, "reduce")
        staged = Staged(tensors, "tensors", True, op)
        root = int(opts.rootRank)
        return self._run(
            opts, lambda: self.comm.reduce_(staged.views, staged.op, root, prescale=prescale),
            lambda: self.comm.reduce_async_(staged.views, staged.op, root, prescale=prescale),
            tensors, staged.finish, "reduce")

    # ---- point to point -------------------------------------------------------------
    def _tag(self, tag):
        if int(tag) >= self._free_tags:
            raise ValueError(f"gradsync backend: tag {tag} is reserved for monitored_barrier "
                             f"(send/recv take tags 0..{self._free_tags - 1})")
        return int(tag)

    def send(self, tensors, dst, tag):
        staged = Staged(tensors, "tensor", False)
        return _work.Work(self.comm.send_async(staged.views, int(dst), self._tag(tag)), tensors,
                          p2p=True, what="send")

    def recv(self, tensors, src, tag):
        staged = Staged(tensors, "tensor", True)
        return _work.Work(self.comm.recv_async_(staged.views, int(src), self._tag(tag)), tensors,
                          staged.finish, p2p=True, source_rank=int(src), what="recv",
                          limit=self.comm.timeout)

    def recv_anysource(self, tensors, tag):
        """A receive from whichever rank sends first (the Work's
        ``source_rank()`` names it once done)."""
        staged = Staged(tensors, "tensor", True)
        return _work.Work(self.comm.recv_any_async_(staged.views, self._tag(tag)), tensors,
                          staged.finish, p2p=True, source_rank=None,
                          what="recv from any source", limit=self.comm.timeout)
