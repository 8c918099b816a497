"""Horovod's timeline (HOROVOD_TIMELINE, hvd.start_timeline) written by
gradsync.horovod: a Chrome trace in Horovod's layout, by the global rank 0.

Each operation is a "process" named after its Horovod name
(``allreduce.grad``, ``allreduce.noname.3``) with, per operation, a
``NEGOTIATE_<KIND>`` span from submission until it starts running and a
``<KIND>`` span while it runs (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL,
REDUCESCATTER, BARRIER, JOIN), ending with its dtype and shape. The first
record carries ``start_time_since_epoch_in_micros``; with mark_cycles (or
HOROVOD_TIMELINE_MARK_CYCLES=1), a ``CYCLE_START`` instant marks each turn
of an executor that runs something. Records are written as they happen and
the file is valid JSON after each one (its closing bracket is rewritten),
so it can be read while training runs.
"""
import json
import threading
import time

__all__ = ["Timeline"]


def _label(kind):
    return {"reduce_scatter": "REDUCESCATTER", "add_set": "PROCESS_SET",
            "remove_set": "PROCESS_SET"}.get(kind, kind.upper())


class Timeline:
    """The process's timeline; inactive (every method a no-op) until
    start(), and on every rank but the writer."""

    def __init__(self, writer=False):
        self.writer = writer        # only the global rank 0 writes
        self._lock = threading.Lock()
        self._file = None
        self._path = None
        self._pids = {}
        self._mark_cycles = False
        self._t0 = 0.0

    @property
    def active(self):
        return self._file is not None

    def start(self, path, mark_cycles=False):
        """Writes into ``path`` from now on (a running timeline on another
        path is closed first; the same path: only mark_cycles changes)."""
        with self._lock:
            self._mark_cycles = bool(mark_cycles)
            if not self.writer or path == self._path:
                return
            self._close()
            self._file = open(path, "wb")
            self._path = path
            self._pids = {}
            self._t0 = time.monotonic()
            epoch = int(time.time() * 1e6)
            self._file.write(b"[\n")
            self._raw({"name": "process_name", "ph": "M", "pid": 0,
                       "args": {"start_time_since_epoch_in_micros": epoch}}, first=True)
            self._raw({"name": "process_sort_index", "ph": "M", "pid": 0,
                       "args": {"sort_index": 0}})

    def stop(self):
        with self._lock:
            self._close()

    def _close(self):
        if self._file is not None:
            self._file.close()
        self._file = None
        self._path = None

    def _raw(self, record, first=False):
        f = self._file
        if not first:  # over the closing bracket
            f.seek(-1, 2)
            f.write(b",\n")
        f.write(json.dumps(record).encode() + b"]")
        f.flush()

    def _us(self):
        return int((time.monotonic() - self._t0) * 1e6)

    def _event(self, name, phase, op=None, args=None):
        with self._lock:
            if self._file is None:
                return
            pid = self._pids.get(name)
            if pid is None:
                pid = self._pids[name] = len(self._pids) + 1
                self._raw({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": name}})
                self._raw({"name": "process_sort_index", "ph": "M", "pid": pid,
                           "args": {"sort_index": pid}})
            record = {"ph": phase}
            if op is not None:
                record["name"] = op
            record["ts"] = self._us()
            record["pid"] = pid
            if args:
                record["args"] = args
            self._raw(record)

    # ---- what the engines record ------------------------------------------------
    def negotiate_start(self, call):
        if self._file is not None:
            self._event(call.name, "B", "NEGOTIATE_" + _label(call.kind))

    def start_call(self, call):
        if self._file is not None:
            self._event(call.name, "E")
            self._event(call.name, "B", _label(call.kind))

    def end(self, call):
        if self._file is None:
            return
        args = {}
        data = call.arrays or []
        if data:
            args = {"dtype": str(getattr(data[0], "dtype", "")),
                    "shape": str(tuple(getattr(data[0], "shape", ())))}
        self._event(call.name, "E", None, args)

    def mark_cycle(self):
        if self._file is None or not self._mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._raw({"ph": "i", "name": "CYCLE_START", "ts": self._us(), "s": "g"})
