"""EngineComm: the part of gs.Communicator that gradsync.torch's
DistributedOptimizer and broadcasts use, routed through a Horovod engine, so
their collectives are matched by name with the others, carry on while other
ranks have called join(), and end when a rank shuts down. That is how the
Horovod shim reuses them unchanged."""


class EngineRequest:
    """A gs.Request look-alike for an engine call (wait, test, done)."""

    __slots__ = ("_engine", "_call", "_tensors")

    def __init__(self, engine, call, tensors):
        self._engine, self._call, self._tensors = engine, call, tensors

    def wait(self):
        self._engine.wait(self._call)
        return self._tensors

    def test(self):
        return self._engine.test(self._call)

    @property
    def done(self):
        return self.test()


class EngineComm:
    """Communicator methods (rank, size, allreduce_, allreduce_async_,
    broadcast_, allgather, barrier) over ``engine``."""

    def __init__(self, engine):
        self.engine = engine
        comm = engine.comm
        self.rank, self.size = comm.rank, comm.size
        self.local_rank, self.local_size = comm.local_rank, comm.local_size

    @property
    def closed(self):
        return self.engine.comm.closed

    @staticmethod
    def _listed(tensors):
        return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]

    def allreduce_async_(self, tensors, op="sum", *, prescale=1.0, postscale=1.0, adasum=None,
                         wire=None, residual=None):
        """wire: as gs.Communicator's (Compression.fp16 on float32); residual
        (error feedback) is not taken here: the drop-in's optimizer has none,
        as Horovod's fp16 has none."""
        if residual is not None:
            raise ValueError("gradsync.horovod: residual (error feedback) is not supported "
                             "through the Horovod engine; use gradsync.torch's "
                             "DistributedOptimizer(wire=...)")
        listed = self._listed(tensors)
        call = self.engine.submit("allreduce", listed, op=op, prescale=prescale,
                                  postscale=postscale, adasum=adasum, wire=wire)
        return EngineRequest(self.engine, call, tensors)

    def allreduce_(self, tensors, op="sum", *, prescale=1.0, postscale=1.0, adasum=None,
                   wire=None, residual=None):
        return self.allreduce_async_(tensors, op, prescale=prescale, postscale=postscale,
                                     adasum=adasum, wire=wire, residual=residual).wait()

    def broadcast_(self, tensors, root=0):
        listed = self._listed(tensors)
        call = self.engine.submit("broadcast", listed, root=int(root))
        self.engine.wait(call)
        return tensors

    def allgather(self, tensors):
        was_list = isinstance(tensors, (list, tuple))
        listed = self._listed(tensors)
        out = self.engine.wait(self.engine.submit("allgather", listed))
        return out if was_list else out[0]

    def barrier(self):
        self.engine.wait(self.engine.submit("barrier", []))

    def __repr__(self):
        return f"<gradsync.horovod EngineComm rank {self.rank} of {self.size}>"
