"""DDP communication hooks for the "gradsync" backend: gradient buckets
averaged through a low-precision wire format (docs/GUIDE.md, "Low-precision
wire formats").

    from gradsync.torch.distributed.hooks import WireState, wire_hook
    model = DDP(model)                       # on a "gradsync" process group
    model.register_comm_hook(WireState("bfloat16"), wire_hook)

torch's own fp16/bf16 hooks cast each bucket and allreduce in the low
precision, so the partial sums round at every hop; this one sends each rank's
shard in the wire format, sums in float32 and rounds once (gradsync's
``allreduce_(wire=...)``), and by default keeps each bucket's rounding error
for the next step (gs.ErrorFeedback).
"""
import torch.distributed as dist

from gradsync.torch.distributed._work import Work
from gradsync.wire import WIRES, ErrorFeedback

__all__ = ["WireState", "wire_hook"]


class WireState:
    """The hook's state: the wire format, the process group (None: the
    default group; it must be a "gradsync" group) and one ErrorFeedback per
    bucket when ``error_feedback`` (the buckets are DDP's, fixed after its
    first iterations; a bucket whose size changes starts a fresh residual)."""

    def __init__(self, wire, process_group=None, error_feedback=True):
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
        self.wire = wire
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self._feedback = {}

    def communicator(self):
        """The gradsync communicator under the state's process group."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        comm = getattr(group, "comm", None)  # the "gradsync" backend's group is ours
        if comm is None:
            raise TypeError("wire_hook needs a process group on the \"gradsync\" backend, not "
                            f"{type(group).__name__}")
        return comm

    def feedback(self, bucket):
        """This bucket's ErrorFeedback (None without error feedback)."""
        if not self.error_feedback:
            return None
        ef = self._feedback.get(bucket.index())
        if ef is None or (ef.state is not None and ef.state[0].size != bucket.buffer().numel()):
            ef = self._feedback[bucket.index()] = ErrorFeedback()
        return ef


def wire_hook(state, bucket):
    """Starts averaging ``bucket``'s gradients over the group through
    ``state.wire`` (float32 sums, one rounding), in place, in the background;
    returns the future of the bucket's buffer DDP waits for at the end of
    backward (so later buckets' gradients are computed meanwhile). The bucket
    must be float32 (or, for a float8 wire, bfloat16/float16)."""
    buf = bucket.buffer()
    comm = state.communicator()
    request = comm.allreduce_async_(buf, op="average", wire=state.wire,
                                    residual=state.feedback(bucket))
    work = Work(request, [buf], what=f"wire_hook allreduce ({state.wire})")
    return work.get_future().then(lambda fut: fut.value()[0])
