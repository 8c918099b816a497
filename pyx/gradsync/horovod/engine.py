"""The ordered engine under gradsync.horovod: Horovod's handles, names and
join() on top of gradsync's ordered collectives (framework-neutral: arrays
are anything gradsync takes).

Horovod's coordinator matches collectives by name, whatever order ranks
submit them in. gradsync matches them by position: the k-th call of every
rank is the same collective, validated before any data moves. This engine
keeps that model and adds what Horovod programs rely on:

- **Names (and shapes) take part in the check.** An operation carries its
  name and its tensors' shapes as a signature of zero-element tensors
  (twelve of them, each one of four float dtypes: 24 bits of a hash) after
  its data. gradsync compares every tensor's dtype across ranks, so two
  ranks submitting different names, or shapes with equal element counts, at
  the same position fail with MismatchError on every rank, before anything
  is written. No bytes move for them.
- **join().** A rank that has joined issues only STATUS calls (a small
  allreduce with a signature no user call has). A rank whose collective
  fails (against a STATUS, or for any other reason) recovers: it waits for
  its pending calls, then issues STATUS calls until every rank is in one.
  That status round says who joined and how many failed calls each
  non-joined rank holds. If nobody joined, the failure was real and is
  raised. Otherwise the lowest non-joined rank broadcasts the descriptions
  of the first n failed calls (n: the fewest any non-joined rank holds) and
  every rank replays them: non-joined ranks with their own arrays (nothing
  was written by the failed attempt: gradsync validates first), joined ranks
  with zeros, as Horovod's joined ranks contribute. Only allreduce and
  barrier can run with joined ranks; the others raise, as in Horovod.
  Ranks holding more failed calls keep them for the next round. A status
  round in which every rank has joined ends join() everywhere.

Recovery costs nothing while every call succeeds: no extra message is sent
unless a collective fails. With GRADSYNC_CHECK=0 (no validation) names are
not checked and join() cannot work.
"""
import hashlib
import pickle
import re

import numpy as np

import gradsync as gs

_PENDING, _DONE, _FAILED, _RAISED = range(4)
_SIG_DTYPES = (np.dtype(np.float16), np.dtype(gs.bfloat16), np.dtype(np.float32),
               np.dtype(np.float64))
_SIG_SLOTS = 12
_REPLAYABLE = ("allreduce", "barrier")


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's error class: a RuntimeError)."""


class MismatchError(HorovodInternalError, gs.MismatchError):
    """The ranks did not make the same call (a gs.MismatchError that is also
    Horovod's HorovodInternalError). No tensor was written."""

    def __init__(self, message="", status=None):
        HorovodInternalError.__init__(self, message)
        self.status = int(status) if status is not None else 3


class JoinedError(HorovodInternalError):
    """A collective that needs data from every rank ran while some ranks had
    called join()."""


def signature_dtypes(name):
    """The dtypes of the zero-element tensors that carry ``name`` (None:
    no signature)."""
    if name is None:
        return ()
    h = int.from_bytes(hashlib.sha1(str(name).encode()).digest()[:3], "little")
    return tuple(_SIG_DTYPES[(h >> (2 * i)) & 3] for i in range(_SIG_SLOTS))


def _dtype_name(dtype):
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def _np_dtype(name):
    return np.dtype(gs.bfloat16) if name == "bfloat16" else np.dtype(name)


def numpy_zeros(dtype_name, shape):
    return np.zeros(shape, _np_dtype(dtype_name))


class Call:
    """One submitted collective: its arrays (data, then signature), what it
    does, its gradsync request or result, and what becomes of it."""

    __slots__ = ("kind", "arrays", "ndata", "args", "name", "request", "result", "error",
                 "state", "finish")

    def __init__(self, kind, arrays, ndata, args, name, finish):
        self.kind, self.arrays, self.ndata, self.args = kind, arrays, ndata, args
        self.name, self.finish = name, finish
        self.request = self.result = self.error = None
        self.state = _PENDING

    def describe(self):
        args = {k: v for k, v in self.args.items() if k != "out"}
        return (self.kind, args, [(_dtype_name(a.dtype), tuple(a.shape)) for a in self.arrays])

    def __repr__(self):
        what = f" {self.name!r}" if self.name is not None else ""
        return f"{self.kind}{what}"


class Engine:
    """Collectives of one process set in submission order, over one
    gs.Communicator. ``ranks``: the process set's global ranks (the global
    rank of member i is ranks[i]); ``zeros(dtype_name, shape)`` makes what a
    joined rank contributes."""

    def __init__(self, comm, ranks, zeros=numpy_zeros):
        self.comm = comm
        self.ranks = list(ranks)
        self.zeros = zeros
        self.joining = False
        self._open = []            # calls not yet resolved, in submission order
        self._rounds = 0
        self._joined_at = {}
        status_sig = signature_dtypes("gradsync.horovod.status")
        self._status_sig = [np.empty(0, dt) for dt in status_sig]

    # ---- submission ---------------------------------------------------------
    def submit(self, kind, arrays, name=None, sig=(), finish=None, **args):
        """Starts a collective (asynchronously where gradsync has an
        asynchronous form) and returns its Call. ``sig``: the name's
        signature tensors, in the data's memory."""
        call = Call(kind, list(arrays) + list(sig), len(arrays), args, name, finish)
        self._open.append(call)
        try:
            self._start(call)
        except BaseException:  # not a collective's failure (a bug, Ctrl-C): forget the call
            self._open.remove(call)
            raise
        if call.state == _FAILED:
            self._recover()
        return call

    def reject(self, kind, exc, name=None):
        """This rank's arguments for a ``kind`` call are bad (``exc``, found
        before gradsync saw them): the other ranks' matching call fails with
        MismatchError instead of waiting, every rank recovers, and this rank
        raises ``exc``."""
        call = Call(kind, [], 0, {}, name, None)
        self._open.append(call)
        self._failed(call, exc)
        try:
            gs._core.abandon(self.comm.handle, exc)
        except gs.Error:
            pass
        return self.wait(call)

    def _start(self, call):
        comm, a, args = self.comm, call.arrays, call.args
        try:
            if call.kind == "allreduce":
                call.request = comm.allreduce_async_(a, args["op"], prescale=args["prescale"],
                                                     postscale=args["postscale"],
                                                     adasum=args.get("adasum"))
            elif call.kind == "broadcast":
                call.request = comm.broadcast_async_(a, root=args["root"])
            elif call.kind == "reduce_scatter" and "out" in args:
                call.request = comm.reduce_scatter_async(a, args["out"], args["op"],
                                                         prescale=args["prescale"],
                                                         postscale=args["postscale"])
                call.result = args["out"]
            else:
                call.result = self._blocking(call.kind, a, args)
                call.state = _DONE
        except gs.Error as exc:
            self._failed(call, exc)
        except (ValueError, TypeError) as exc:  # this rank's arguments: others mismatch
            self._failed(call, exc)

    def _blocking(self, kind, arrays, args):
        comm = self.comm
        if kind == "allgather":
            return comm.allgather(arrays)
        if kind == "reduce_scatter":
            return comm.reduce_scatter(arrays, args["op"], prescale=args["prescale"],
                                       postscale=args["postscale"])
        if kind == "alltoall":  # what each rank sends here, then the rows themselves
            recv = [int(c) for c in comm.alltoall_counts(args["send_counts"])]
            return comm.alltoall(arrays[0], args["send_counts"], recv_counts=recv), recv
        if kind == "allreduce":
            return comm.allreduce_(arrays, args["op"], prescale=args["prescale"],
                                   postscale=args["postscale"], adasum=args.get("adasum"))
        if kind == "barrier":
            return comm.barrier()
        raise ValueError(f"unknown collective {kind!r}")

    @staticmethod
    def _failed(call, exc):
        call.state = _FAILED
        call.error = exc

    # ---- completion ---------------------------------------------------------
    def test(self, call):
        """True once the call has finished (successfully or not)."""
        if call.state == _PENDING:
            try:
                if not call.request.test():
                    return False
                call.state = _DONE
            except (gs.Error, ValueError, TypeError) as exc:
                self._failed(call, exc)
        return True

    def wait(self, call):
        """Waits for the call, recovering from failures (replaying it when
        other ranks have joined); returns what its finish() makes of it."""
        while True:
            self._settle(call)
            if call.state == _FAILED:
                self._recover()
                continue
            if call in self._open:
                self._open.remove(call)
            if call.state == _RAISED:
                raise call.error
            out = call.result if call.result is not None else call.arrays[:call.ndata]
            if call.kind in ("allgather", "reduce_scatter"):
                out = out[:call.ndata]
            return call.finish(out) if call.finish is not None else out

    def _settle(self, call):
        """A pending call's request waited for: done, or failed (recorded)."""
        if call.state != _PENDING:
            return
        try:
            call.request.wait()
            call.state = _DONE
        except (gs.Error, ValueError, TypeError) as exc:
            self._failed(call, exc)

    def drain(self):
        """Waits for every open call (errors stay with their calls)."""
        for call in list(self._open):
            self._settle(call)
        if any(c.state == _FAILED for c in self._open):
            self._recover()

    # ---- recovery and join ------------------------------------------------------
    def _recover(self):
        for call in self._open:  # every later call fails too: wait for them
            if call.state == _PENDING:
                try:
                    call.request.wait()
                    call.state = _DONE
                except (gs.Error, ValueError, TypeError) as exc:
                    self._failed(call, exc)
        failed = [c for c in self._open if c.state == _FAILED]
        while failed:
            joined, counts = self._status_round(False, len(failed))
            if not joined.any():
                self._raise_all(failed)
                return
            failed = failed[self._replay(joined, counts, failed):]

    def join(self):
        """Horovod's join(): contribute zeros to the other ranks' allreduces
        until every rank has joined; returns the rank that joined last (a
        global rank, the same on every rank)."""
        self.drain()
        self.joining = True
        try:
            while True:
                joined, counts = self._status_round(True, 0)
                if joined.all():
                    return self._last_joined()
                self._replay(joined, counts, [])
        finally:
            self.joining = False

    def _status_round(self, joined, nfailed):
        """One successful STATUS allreduce: (joined flags, failed counts) per
        member. Repeats while other ranks are still in other calls."""
        size, me = self.comm.size, self.comm.rank
        while True:
            vec = np.zeros(2 * size, np.int64)
            vec[me] = 1 if joined else 0
            vec[size + me] = nfailed
            try:
                self.comm.allreduce_([vec] + self._status_sig, op="max")
                break
            except gs.MismatchError:
                continue
        self._rounds += 1
        flags = vec[:size] != 0
        for r in np.flatnonzero(flags):
            self._joined_at.setdefault(int(r), self._rounds)
        return flags, vec[size:]

    def _last_joined(self):
        last = max(self._joined_at.items(), key=lambda kv: (kv[1], kv[0]))[0]
        self._joined_at = {}
        return self.ranks[last]

    def _replay(self, joined, counts, failed):
        """Replays the first n failed calls of the non-joined ranks (n: the
        fewest any holds) with zeros from joined ranks; returns n."""
        others = np.flatnonzero(~joined)
        n = int(min(counts[r] for r in others))
        root = int(others[0])
        mine = [c.describe() for c in failed[:n]] if self.comm.rank == root else None
        descs = self._broadcast_object(mine, root)
        who = [self.ranks[r] for r in np.flatnonzero(joined)]
        for i, (kind, args, specs) in enumerate(descs):
            call = failed[i] if failed else None
            if kind not in _REPLAYABLE:
                if call is not None:
                    call.state = _RAISED
                    call.error = JoinedError(
                        f"{call}: rank(s) {who} have called join(); {kind} needs every rank "
                        "(only allreduce and barrier run with joined ranks, as in Horovod)")
                continue
            same = call is not None and call.describe() == (kind, args, specs)
            arrays = call.arrays if same else [self.zeros(d, s) for d, s in specs]
            try:
                self._blocking(kind, arrays, args)
                if call is not None:
                    call.state = _DONE if same else _RAISED
                    if not same:
                        call.error = MismatchError(
                            f"{call}: the ranks' calls differ ({descs[i][0]} on rank "
                            f"{self.ranks[root]})")
            except (gs.Error, ValueError, TypeError) as exc:
                if call is not None:
                    call.state = _RAISED
                    call.error = _translate(exc, call)
        return n

    def _broadcast_object(self, obj, root):
        data = pickle.dumps(obj) if self.comm.rank == root else b""
        n = np.array([len(data)], np.int64)
        self.comm.broadcast_(n, root=root)
        buf = (np.frombuffer(data, np.uint8).copy() if self.comm.rank == root
               else np.empty(int(n[0]), np.uint8))
        self.comm.broadcast_(buf, root=root)
        return pickle.loads(buf.tobytes())

    def _raise_all(self, failed):
        first = failed[0]
        for call in failed:
            call.state = _RAISED
            call.error = _translate(call.error, call) if call is first else HorovodInternalError(
                f"{call} did not run: an earlier collective ({first}) failed: {first.error}")


def _translate(exc, call):
    """Horovod raises HorovodInternalError (a RuntimeError) for collectives
    that fail across ranks; argument errors found on this rank keep their
    own class (ValueError, TypeError)."""
    if isinstance(exc, gs.MismatchError) and not isinstance(exc, MismatchError):
        text = str(exc)
        found = re.search(r"tensor (\d+) differs", text)
        what = (f"the ranks submitted differently named or shaped collectives at this point "
                f"({call} here): " if found and int(found.group(1)) >= call.ndata else "")
        hint = (" gradsync.horovod matches collectives by the order each rank submits "
                "them, and names take part in the check: submit them in the same order on "
                "every rank." if call.name is not None else "")
        err = MismatchError(f"{call}: {what}{text}.{hint}", exc.status)
        err.__cause__ = exc
        return err
    if isinstance(exc, gs.Error) and not isinstance(exc, (ValueError, TypeError)):
        err = HorovodInternalError(f"{call}: {exc}")
        err.__cause__ = exc
        return err
    return exc
