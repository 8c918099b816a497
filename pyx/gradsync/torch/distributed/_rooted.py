"""The gradsync backend's rooted collectives (gather, scatter, reduce) and
point-to-point calls, as a base class of ProcessGroupGradsync: each converts
torch's arguments into one gradsync call on flat views, run by the group's
``_run`` (blocking or asynchronous, as torch asked)."""
import torch
import torch.distributed as dist

from gradsync.torch.distributed import _tensors, _work
from gradsync.torch.distributed._tensors import Staged, export


def _rooted_args(comm, opts, mine, at_root, what, role):
    """(root, ranks, this rank's one tensor, the root's list of one tensor
    per rank): torch passes a list per device, gradsync takes one device;
    the root's list must hold a tensor for every rank."""
    if len(mine) != 1:
        _tensors.unsupported(f"{what} of several tensors per rank")
    root, ranks = int(opts.rootRank), comm.size
    every = at_root[0] if at_root else []
    if comm.rank == root and len(every) != ranks:
        raise ValueError(f"gradsync backend: {what} needs {ranks} {role} tensors at the "
                         f"root, got {len(every)}")
    return root, ranks, mine[0], every


class RootedAndPointToPoint:
    """gather, scatter, reduce, send, recv and recv_anysource; the subclass
    provides ``comm``, ``_run`` and ``_free_tags``."""

    # ---- rooted -------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        root, P, inp, outs = _rooted_args(self.comm, opts, input_tensors, output_tensors,
                                          "gather", "output")
        flat_in = _tensors.flat_view(inp.contiguous())
        flat_out, finish = None, None
        if self.comm.rank == root:
            flat_out = torch.empty(sum(_tensors.numel_units(t) for t in outs),
                                   dtype=flat_in.dtype, device=inp.device)

            def finish():
                _tensors.scatter_into(flat_out, outs)
        counts = [flat_in.numel()] * P
        out = None if flat_out is None else export(flat_out)
        return self._run(
            opts, lambda: self.comm.gather_async(export(flat_in), out, root, counts).wait(),
            lambda: self.comm.gather_async(export(flat_in), out, root, counts),
            list(outs), finish, "gather")

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        root, P, out, ins = _rooted_args(self.comm, opts, output_tensors, input_tensors,
                                         "scatter", "input")
        staged_out = Staged([out], "output", True)
        flat_in = export(_tensors.cat(ins)) if self.comm.rank == root else None
        counts = [_tensors.numel_units(out)] * P
        view = staged_out.views[0]
        return self._run(
            opts, lambda: self.comm.scatter_async(flat_in, view, root, counts).wait(),
            lambda: self.comm.scatter_async(flat_in, view, root, counts),
            [out], staged_out.finish, "scatter")

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op, prescale = _tensors.reduce_op(opts.reduceOp, "reduce")
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
