"""Shutdown messages between the processes under gradsync.horovod (the
engine's docstring, "Shutdown and failure")."""
import threading
import time

import numpy as np

import gradsync as gs


class Notices:
    """Shutdown messages between the processes: one receive posted from
    every other rank on a communicator of their own (gradsync point to
    point), and one message to each when this rank shuts down or fails."""

    _TAG = 7
    _kept = []  # every instance, to the end of the process: MPI may still
    # write into their posted receives (a late message after a shutdown)

    def __init__(self, comm):
        Notices._kept.append(self)
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._lock = threading.Lock()
        self._bufs = {}
        self._reqs = {}
        self._sent = False
        self._why = None
        self._last = 0.0
        for r in range(self.size):
            if r != self.rank:
                self._bufs[r] = np.zeros(1, np.int64)
                self._reqs[r] = comm.recv_async_(self._bufs[r], r, self._TAG)

    def announce(self, why):
        """Tells every other rank that this one has shut down (once)."""
        with self._lock:
            if self._sent:
                return
            self._sent = True
        self._code = np.ones(1, np.int64)  # kept with the requests (the instance lives on)
        self._sends = []
        for r in range(self.size):
            if r != self.rank:
                try:
                    self._sends.append(self.comm.send_async(self._code, r, self._TAG))
                except gs.Error:
                    pass

    def poll(self, force=False):
        """Why another rank shut down, once one did (None before)."""
        if self._why is not None:
            return self._why
        now = time.monotonic()
        if not force and now - self._last < 0.02:
            return None
        with self._lock:
            self._last = now
            for r, req in list(self._reqs.items()):
                try:
                    done = req.test()
                except gs.Error:
                    done = True
                if done:
                    del self._reqs[r]
                    self._why = (f"Horovod has been shut down: rank {r} shut down or "
                                 "stopped (an exception, an exit, or a stalled operation "
                                 "there); collectives cannot complete without it")
                    break
        return self._why
