"""The engine under gradsync.horovod: Horovod's named operations, handles,
join() and shutdown on gradsync's validated collectives (framework-neutral:
arrays are anything gradsync takes).

Horovod's coordinator matches operations by name, whatever order the ranks
submit them in; two operations of one name in flight on a rank is an error.
This engine gives the same result with no coordinator message while the
ranks agree:

- **Every operation has a name.** The caller's (``allreduce.grad``), or
  ``<kind>.noname.<k>`` for the k-th unnamed operation of that kind on this
  process set (``barrier.noname`` and ``join.noname`` as in Horovod). The
  name (with the tensors' shapes, which Horovod compares too) travels as
  the collective's call tag (``gs.call_options(tag=...)``: 64 bits of a
  hash), which gradsync's cross-rank check compares with the call's other
  arguments: no message of its own, no bytes moved.
- **Fast path.** One executor thread per process set runs the operations in
  submission order, each a blocking gradsync collective. While every rank
  submits the same names in the same order, that is all that happens: the
  k-th operations meet and their names agree.
- **Negotiation.** When a collective fails the check (ranks submitted
  different names at that point, or shapes differ, or a rank joined),
  nothing has been written and every rank's executor switches to rounds:
  a STATUS allreduce (a tag no operation has; ranks still in other
  collectives fail the check against it and come to the round too), then
  every rank's list of queued names. Names queued on every rank that has
  not joined run, in the order of the lowest such rank's list; joined ranks
  contribute zeros to allreduces (and take part in barriers), other kinds
  fail on every rank with JoinedError, as in Horovod. A name whose tensors
  differ across ranks fails in gradsync's check, on every rank at once. A
  round after which no rank holds a queued name returns everyone to the
  fast path. The rounds repeat (with a short pause while nothing changes)
  as long as some rank holds names the others have not submitted: every
  rank's communicator stays in step.
- **Shutdown and failure.** ``shutdown()`` (also run at exit) and any
  failure of the communicator itself (a timeout: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
  or GRADSYNC_TIMEOUT_SECONDS) tell every other rank through a message
  (gradsync point to point on a communicator of their own, received in the
  background). A rank that learns of it ends its own waits (the executor's
  wait inside gradsync is abandoned), raises HorovodInternalError for every
  pending operation, and refuses new ones, as Horovod's shut-down ranks do.
  A name that some ranks submitted and others have not, for longer than
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, fails every queued operation on
  every rank, and the ranks carry on in step (Horovod shuts down instead).

With GRADSYNC_CHECK=0 (no cross-rank check) names are not compared, and a
mismatch is not detected: the ranks must submit in the same order.

This module is the Engine: submission, completion, shutdown, the executor
thread and the fast path. The negotiation rounds are in
gradsync.horovod.negotiation, a Call and its tag in
gradsync.horovod.calls, the error classes in gradsync.horovod.errors, and
the shutdown messages between processes in gradsync.horovod.notices.
"""
import collections
import threading
import time

import numpy as np

import gradsync as gs

from .calls import _DONE, _QUEUED, _RAISED, _RUNNING, Call, numpy_zeros
from .errors import ShutdownError, _Abandoned
from .negotiation import NegotiationRounds

_FIXED_NAMES = {"barrier": "barrier.noname", "join": "join.noname"}


class Engine(NegotiationRounds):
    """Operations of one process set, matched by name across its ranks, over
    one gs.Communicator. ``ranks``: the set's global ranks (member i is
    global rank ranks[i]); ``zeros(dtype_name, shape)`` makes what a joined
    rank contributes; ``notices``: the process's Notices (shutdown
    messages), or None."""

    GRACE_SECONDS = 2.0  # for a collective under way when a shutdown arrives

    def __init__(self, comm, ranks, zeros=numpy_zeros, notices=None, timeline=None):
        self.comm = comm
        self.ranks = list(ranks)
        self.zeros = zeros
        self.notices = notices
        self.timeline = timeline
        self._cv = threading.Condition()
        self._queue = []                      # calls not finished, in submission order
        self._names = {}                      # name -> its call, until done and waited for
        self._counters = collections.Counter()   # kind -> unnamed operations so far
        self._negotiating = False
        self._closed = None                   # why, once shut down
        self._thread = None
        self._joined_round = {}
        self._rounds = 0
        self._warned = set()
        self._stall_warn = 60.0
        self._stall_shutdown = 0.0

    def configure(self, stall_warn=None, stall_shutdown=None):
        """Stall warning and stall shutdown, in seconds (0: never)."""
        if stall_warn is not None:
            self._stall_warn = float(stall_warn)
        if stall_shutdown is not None:
            self._stall_shutdown = float(stall_shutdown)

    # ---- submission (caller's thread) ----------------------------------------
    def name_for(self, kind, name):
        """The operation's full name: Horovod's ``<kind>.<name>``, or the
        next unnamed one of that kind."""
        if name is not None:
            return f"{kind}.{name}"
        if kind in _FIXED_NAMES:
            return _FIXED_NAMES[kind]
        with self._cv:
            k = self._counters[kind]
            self._counters[kind] = k + 1
        return f"{kind}.noname.{k}"

    def _consume_name(self, name):
        """Another rank's unnamed operation ran (or failed) here without this
        rank submitting it (this rank had joined): its number is used up
        here too, so the ranks' next unnamed operations keep matching."""
        kind, sep, k = name.rpartition(".noname.")
        if sep and k.isdigit():
            with self._cv:
                self._counters[kind] = max(self._counters[kind], int(k) + 1)

    def submit(self, kind, arrays, name=None, tag=None, finish=None, context=None, **args):
        """Queues an operation for the executor and returns its Call at once.
        ``name``: the caller's name (None: unnamed); ``tag(full_name)``: the
        str the operation's call tag is made of (default: the full name;
        the torch front end adds the tensors' shapes); ``context``: a
        callable returning a context manager the executor runs the
        collective in (a CUDA stream). Raises ValueError when an operation
        of that name is in flight on this rank, ShutdownError after a
        shutdown."""
        self.check_notices()
        with self._cv:
            self._raise_if_closed()
            full = self.name_for(kind, name)
            prior = self._names.get(full)
            if prior is not None and not (prior.done.is_set() and prior.observed):
                raise ValueError(f"{full}: an operation of this name is already in flight on "
                                 f"rank {self.comm.rank} of the set (Horovod: duplicate tensor "
                                 "name); names of outstanding operations must be unique")
            call = Call(kind, list(arrays), args, full, full if tag is None else tag(full),
                        finish, context, name is None)
            self._names[full] = call
            self._queue.append(call)
            if self.timeline is not None:
                self.timeline.negotiate_start(call)
            self._start_thread()
            self._cv.notify_all()
        return call

    def _raise_if_closed(self):
        if self._closed is not None:
            raise ShutdownError(self._closed)

    def _start_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._executor, daemon=True,
                                            name=f"gradsync.horovod engine {self.ranks}")
            self._thread.start()

    # ---- completion (caller's thread) ----------------------------------------
    def test(self, call):
        """True once the call has finished (successfully or not)."""
        if call.done.is_set():
            call.observed = True
            return True
        self.check_notices()
        return call.done.is_set()

    def wait(self, call):
        """Waits for the call; returns what its finish() makes of it, or
        raises its error."""
        while not call.done.wait(0.05):
            self.check_notices()
        call.observed = True
        with self._cv:  # what finished before this wait returns is known finished,
            # so its name is free again: forget the call and its tensors (issue 34:
            # every unnamed call has a name of its own and stayed here for good)
            for full in [n for n, other in self._names.items() if other.done.is_set()]:
                del self._names[full]
        if call.state == _RAISED:
            raise call.error
        out = call.result if call.result is not None else call.arrays
        return call.finish(out) if call.finish is not None else out

    def join(self):
        """Horovod's join(): contribute zeros to the other ranks' allreduces
        until every rank has joined; returns the global rank that joined
        last (the same on every rank)."""
        return self.wait(self.submit("join", []))

    def check_notices(self):
        """Reads shutdown messages from other ranks (cheap when none came):
        one ends this engine's waits."""
        if self.notices is not None:
            why = self.notices.poll()
            if why is not None and self._closed is None:
                self.shutdown_local(why)

    # ---- shutdown --------------------------------------------------------------
    def shutdown_local(self, why):
        """Ends this engine on this rank: every pending call raises
        ShutdownError(why), later submissions too; the executor's wait, if
        any, is abandoned (the communicator is then unusable)."""
        with self._cv:
            if self._closed is not None:
                return
            self._closed = why
            running = [c for c in self._queue if c.state == _RUNNING]
            for call in [c for c in self._queue if c.state != _RUNNING]:
                self._finish(call, error=ShutdownError(f"{call}: {why}"))
            self._cv.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            for call in running:
                self._finish(call, error=ShutdownError(f"{call}: {why}"))
            return
        # a collective already under way may be completing (its peers took
        # part before they shut down): it gets a moment, then its wait ends
        deadline = time.monotonic() + self.GRACE_SECONDS
        for call in running:
            call.done.wait(max(0.0, deadline - time.monotonic()))
        gs.abandon_waits(thread.ident)
        thread.join(timeout=10.0)
        gs.abandon_waits(thread.ident, False)
        for call in running:
            self._finish(call, error=ShutdownError(f"{call}: {why}"))

    @property
    def closed(self):
        return self._closed

    # ---- the executor thread ----------------------------------------------------
    def _executor(self):
        gs.flight_use_site(-1)  # its negotiation calls have no user line
        try:
            while True:
                with self._cv:
                    while self._closed is None and not self._negotiating and \
                            not any(c.state == _QUEUED for c in self._queue):
                        self._cv.wait()
                    if self._closed is not None:
                        return
                    call = None if self._negotiating else \
                        next(c for c in self._queue if c.state == _QUEUED)
                if call is None or call.kind == "join":
                    self._negotiating = True
                    self._round()
                else:
                    self._fast(call)
        except _Abandoned:
            return
        except BaseException as exc:  # the communicator failed: every rank must know
            if self._closed is not None:
                return
            why = f"gradsync.horovod stopped on rank {self.ranks[self.comm.rank]}: {exc}"
            if self.notices is not None:
                self.notices.announce(why)
            self.shutdown_local(why)

    def _fast(self, call):
        """The head call as the k-th collective of every rank; a failed
        check (nothing written) switches to negotiation."""
        if self.timeline is not None:
            self.timeline.mark_cycle()
        try:
            self._execute(call, call.arrays, mine=True)
        except gs.MismatchError:
            self._negotiating = True
            return
        except (ValueError, TypeError) as exc:  # this rank's arguments: the others mismatch
            call.args["local_error"] = exc
            self._negotiating = True
            return

    def _execute(self, call, arrays, mine):
        """Runs one collective. ``mine``: the arrays are this rank's (else a
        joined rank's zeros, and nothing is recorded)."""
        if mine and self.timeline is not None:
            self.timeline.start_call(call)
        if mine:
            call.state = _RUNNING
        # the flight record names the line that submitted it (the rounds' own
        # collectives, none)
        gs.flight_use_site(call.site if mine else -1)
        try:
            ctx = call.context() if (mine and call.context is not None) else None
            with gs.call_options(tag=call.tag):
                if ctx is not None:
                    with ctx:
                        result = self._collective(call.kind, arrays, call.args)
                else:
                    result = self._collective(call.kind, arrays, call.args)
        except gs.MismatchError:
            if mine:
                call.state = _QUEUED
            raise
        except (ValueError, TypeError):
            if mine:
                call.state = _QUEUED
            raise
        except gs.Error as exc:
            if self._closed is not None:
                raise _Abandoned() from exc
            raise
        if mine:
            self._finish(call, result=result)

    def _collective(self, kind, a, args):
        comm = self.comm
        if kind == "allreduce":
            comm.allreduce_(a, args["op"], prescale=args["prescale"],
                            postscale=args["postscale"], adasum=args.get("adasum"),
                            wire=args.get("wire"))
            return None
        if kind == "broadcast":
            comm.broadcast_(a, root=args["root"])
            return None
        if kind == "allgather":
            return comm.allgather(a)
        if kind == "reduce_scatter":
            outs = list(args["out"])
            made = []

            def alloc(array, shape):
                made.append(outs[len(made)] if len(made) < len(outs)
                            else gs.empty_like(array, shape))
                return made[-1]
            comm._reduce_scatter(a, args["op"], args["prescale"], args["postscale"], alloc)
            return outs[:len(a)]
        if kind == "alltoall":
            counts = np.asarray(args["send_counts"], np.int64)
            matrix = comm.allgather(counts).reshape(comm.size, comm.size)
            recv = [int(c) for c in matrix[:, comm.rank]]
            return comm.alltoall(a[0], args["send_counts"], recv_counts=recv), recv
        if kind in ("barrier", "add_set", "remove_set"):
            comm.allreduce_(np.zeros(1, np.int32), "sum")
            run = args.get("run")
            return run() if run is not None else None
        raise ValueError(f"unknown collective {kind!r}")

    def _finish(self, call, result=None, error=None):
        """Records a call's outcome and wakes its waiters."""
        if call.done.is_set():
            return
        if error is not None:
            call.state, call.error = _RAISED, error
        else:
            call.state, call.result = _DONE, result
        if self.timeline is not None:
            self.timeline.end(call)
        with self._cv:
            if call in self._queue:
                self._queue.remove(call)
        call.done.set()
