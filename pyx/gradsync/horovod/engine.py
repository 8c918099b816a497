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
  name and the tensors' shapes travel with the data as a signature of
  zero-element tensors (twelve, each one of four float dtypes: 24 bits of a
  hash), which gradsync's cross-rank check compares like any dtype: no
  bytes move for them.
- **Fast path.** One executor thread per process set runs the operations in
  submission order, each a blocking gradsync collective. While every rank
  submits the same names in the same order, that is all that happens: the
  k-th operations meet and their names agree.
- **Negotiation.** When a collective fails the check (ranks submitted
  different names at that point, or shapes differ, or a rank joined),
  nothing has been written and every rank's executor switches to rounds:
  a STATUS allreduce (a signature no operation has; ranks still in other
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
"""
import collections
import hashlib
import logging
import pickle
import threading
import time

import numpy as np

import gradsync as gs

from . import stall_record

log = logging.getLogger("gradsync.horovod")

_QUEUED, _RUNNING, _DONE, _RAISED = range(4)
_SIG_DTYPES = (np.dtype(np.float16), np.dtype(gs.bfloat16), np.dtype(np.float32),
               np.dtype(np.float64))
_SIG_SLOTS = 12
_JOIN_REPLAYABLE = ("allreduce", "barrier")
_FIXED_NAMES = {"barrier": "barrier.noname", "join": "join.noname"}


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


class ShutdownError(HorovodInternalError):
    """gradsync.horovod has been shut down on this rank or another."""


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


def _kind_label(kind):
    """Horovod's name of an operation type (timeline and messages)."""
    return {"reduce_scatter": "REDUCESCATTER", "add_set": "PROCESS_SET_ADD",
            "remove_set": "PROCESS_SET_REMOVE"}.get(kind, kind.upper())


class Call:
    """One submitted operation: its arrays (data, then signature), what it
    does, its result, and what becomes of it."""

    __slots__ = ("kind", "arrays", "ndata", "args", "name", "result", "error", "state",
                 "finish", "done", "observed", "submitted", "context", "unnamed", "site")

    def __init__(self, kind, arrays, ndata, args, name, finish, context, unnamed):
        self.kind, self.arrays, self.ndata, self.args = kind, arrays, ndata, args
        self.name, self.finish, self.context, self.unnamed = name, finish, context, unnamed
        self.result = self.error = None
        self.state = _QUEUED
        self.done = threading.Event()
        self.observed = False
        self.submitted = time.monotonic()
        self.site = gs._core.flight_site_here()  # the submitting line, for the record

    def describe(self):
        """What a rank that joined needs to take part: kind, arguments, the
        data's (dtype, shape) and the signature's dtypes."""
        args = {k: v for k, v in self.args.items() if k not in ("out", "run")}
        specs = [(_dtype_name(a.dtype), tuple(a.shape)) for a in self.arrays[:self.ndata]]
        sig = [_dtype_name(a.dtype) for a in self.arrays[self.ndata:]]
        return (self.kind, args, specs, sig)

    def __repr__(self):
        return self.name


class _Abandoned(Exception):
    """The executor was told to stop (shutdown) while it waited."""


class Engine:
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
        self._status_sig = [np.empty(0, dt) for dt in signature_dtypes("gradsync.horovod.status")]

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

    def submit(self, kind, arrays, name=None, sig=None, finish=None, context=None, **args):
        """Queues an operation for the executor and returns its Call at once.
        ``name``: the caller's name (None: unnamed); ``sig(full_name)``: the
        signature tensors of the operation's full name, in the data's memory
        (default: NumPy arrays, for host data); ``context``: a callable
        returning a context manager the executor runs the collective in (a
        CUDA stream). Raises ValueError when an operation of that name is in
        flight on this rank, ShutdownError after a shutdown."""
        self.check_notices()
        with self._cv:
            self._raise_if_closed()
            full = self.name_for(kind, name)
            prior = self._names.get(full)
            if prior is not None and not (prior.done.is_set() and prior.observed):
                raise ValueError(f"{full}: an operation of this name is already in flight on "
                                 f"rank {self.comm.rank} of the set (Horovod: duplicate tensor "
                                 "name); names of outstanding operations must be unique")
            sig = [np.empty(0, dt) for dt in signature_dtypes(full)] if sig is None \
                else list(sig(full))
            call = Call(kind, list(arrays) + sig, len(arrays), args, full, finish,
                        context, name is None)
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
        out = call.result if call.result is not None else call.arrays[:call.ndata]
        return call.finish(out) if call.finish is not None else out

    def drain(self):
        """Waits for every queued call (their errors stay with them)."""
        for call in list(self._queue):
            while not call.done.wait(0.05):
                self.check_notices()

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
        gs._core.abandon_waits(thread.ident)
        thread.join(timeout=10.0)
        gs._core.abandon_waits(thread.ident, False)
        for call in running:
            self._finish(call, error=ShutdownError(f"{call}: {why}"))

    @property
    def closed(self):
        return self._closed

    # ---- the executor thread ----------------------------------------------------
    def _executor(self):
        gs._core.flight_use_site(-1)  # its negotiation calls have no user line
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
        gs._core.flight_use_site(call.site if mine else -1)
        try:
            ctx = call.context() if (mine and call.context is not None) else None
            if ctx is not None:
                with ctx:
                    result = self._collective(call.kind, arrays, call.ndata, call.args)
            else:
                result = self._collective(call.kind, arrays, call.ndata, call.args)
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

    def _collective(self, kind, a, ndata, args):
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
            return comm.allgather(a)[:ndata]
        if kind == "reduce_scatter":
            outs = list(args["out"])
            made = []

            def alloc(array, shape):
                made.append(outs[len(made)] if len(made) < len(outs)
                            else gs._core.empty_like(array, shape))
                return made[-1]
            comm._reduce_scatter(a, args["op"], args["prescale"], args["postscale"], alloc)
            return outs[:ndata]
        if kind == "alltoall":
            counts = np.asarray(args["send_counts"], np.int64)
            matrix = comm.allgather([counts] + a[ndata:])[0].reshape(comm.size, comm.size)
            recv = [int(c) for c in matrix[:, comm.rank]]
            return comm.alltoall(a[0], args["send_counts"], recv_counts=recv), recv
        if kind in ("barrier", "add_set", "remove_set"):
            comm.allreduce_([np.zeros(1, np.int32)] + a[ndata:], "sum")
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
        call.arrays = call.arrays if error is None else call.arrays[:call.ndata]
        with self._cv:
            if call in self._queue:
                self._queue.remove(call)
        call.done.set()

    # ---- negotiation rounds ----------------------------------------------------
    def _rendezvous(self, joined):
        """The STATUS allreduce: returns each member's state (1 present, 2
        joined). Repeats while other ranks are still in other collectives."""
        size, me = self.comm.size, self.comm.rank
        while True:
            if self._closed is not None:
                raise _Abandoned()
            vec = np.zeros(size, np.int64)
            vec[me] = 2 if joined else 1
            try:
                self.comm.allreduce_([vec] + self._status_sig, op="max")
                return vec
            except gs.MismatchError:
                continue
            except gs.Error as exc:
                if self._closed is not None:
                    raise _Abandoned() from exc
                raise

    def _exchange(self, mine):
        """Every member's list of queued operations (a collective every
        member makes once it is in the round)."""
        data = np.frombuffer(pickle.dumps(mine), np.uint8).copy()
        size = self.comm.size
        lengths = np.zeros(size, np.int64)
        lengths[self.comm.rank] = data.size
        self.comm.allreduce_(lengths, "sum")
        gathered = self.comm.allgather(data)
        out, start = [], 0
        for n in lengths.tolist():
            out.append(pickle.loads(gathered[start:start + n].tobytes()))
            start += n
        return out

    def _round(self):
        gs._core.flight_use_site(-1)  # the round's own collectives have no user line
        with self._cv:
            queued = [c for c in self._queue if c.state == _QUEUED]
        join_call = next((c for c in queued if c.kind == "join"), None)
        ops = [c for c in queued if c.kind != "join"]
        states = self._rendezvous(join_call is not None)
        self._rounds += 1
        if self.timeline is not None:
            self.timeline.mark_cycle()
        now = time.monotonic()
        with self._cv:
            counters = dict(self._counters)
        exchanged = self._exchange((counters, [
            (c.name, c.describe(), now - c.submitted,
             repr(c.args["local_error"]) if "local_error" in c.args else None) for c in ops]))
        all_counters = [e[0] for e in exchanged]
        lists = [e[1] for e in exchanged]
        size = self.comm.size
        joined = [int(s) == 2 for s in states]
        for r in range(size):
            if joined[r]:
                self._joined_round.setdefault(r, self._rounds)
        active = [r for r in range(size) if not joined[r]]
        by_rank = [{entry[0]: entry for entry in lst} for lst in lists]
        mine = {c.name: c for c in ops}
        if active:
            ref = active[0]
            ready = [e[0] for e in lists[ref] if all(e[0] in by_rank[r] for r in active)]
        else:
            ref = next((r for r in range(size) if lists[r]), None)
            ready = [e[0] for e in lists[ref]] if ref is not None else []
        progress = bool(ready)
        for name in ready:
            self._run_ready(name, by_rank, ref, mine, joined)
        if not active:  # every member has joined: join() returns everywhere
            last = max(self._joined_round.items(), key=lambda kv: (kv[1], kv[0]))[0]
            self._joined_round = {}
            if join_call is not None:
                self._finish(join_call, result=self.ranks[last])
            progress = True
        left = [[e for e in lst if e[0] not in ready] for lst in lists]
        if self._check_stall(left, active, mine, all_counters):
            left = [[] for _ in lists]
        if not any(left) and all(not j for j in joined):
            self._negotiating = False
        elif not progress:
            self._pause(len(queued))

    def _run_ready(self, name, by_rank, ref, mine, joined):
        """Runs ``name`` on every member (joined ones with zeros), or fails
        it on every rank that queued it."""
        kind, args, specs, sig = by_rank[ref][name][1]
        holders = [r for r in range(len(by_rank)) if name in by_rank[r]]
        call = mine.get(name)
        if call is None:
            self._consume_name(name)
        errors = [(r, by_rank[r][name][3]) for r in holders if by_rank[r][name][3]]
        if errors:  # some rank's arguments failed there: fail it on every holder
            if call is not None:
                local = call.args.get("local_error")
                self._finish(call, error=local if local is not None else MismatchError(
                    f"{call}: rank {self.ranks[errors[0][0]]} could not make this "
                    f"collective: {errors[0][1]}"))
            return
        if len(holders) < len(by_rank) and kind not in _JOIN_REPLAYABLE:
            who = [self.ranks[r] for r in range(len(by_rank)) if r not in holders]
            if call is not None:
                self._finish(call, error=JoinedError(
                    f"{call}: rank(s) {who} have called join(); {kind} needs every rank "
                    "(only allreduce and barrier run with joined ranks, as in Horovod)"))
            return
        if call is not None:
            arrays = call.arrays
        else:  # joined here: zeros in the shape the others described
            arrays = [self.zeros(d, s) for d, s in specs] + [self.zeros(d, (0,)) for d in sig]
            call = Call(kind, arrays, len(specs), dict(args), name, None, None, False)
            try:
                self._execute(call, arrays, mine=False)
            except (gs.MismatchError, ValueError, TypeError):
                pass
            return
        try:
            self._execute(call, arrays, mine=True)
        except (gs.MismatchError, ValueError, TypeError) as exc:
            self._finish(call, error=_translate(exc, call))

    def _check_stall(self, left, active, mine, all_counters):
        """Names some members queued and others did not: a warning after
        HOROVOD_STALL_CHECK_TIME_SECONDS (rank 0); after
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, every queued operation of every
        member raises HorovodInternalError naming the stalled names and the
        ranks that never submitted them, and the members start again in
        step (their unnamed counters set to the largest any member reached),
        where Horovod shuts down. Decided from the shared lists, so every
        member decides alike. Returns whether that happened."""
        ages = {}
        for r, lst in enumerate(left):
            for name, _desc, age, _err in lst:
                ages.setdefault(name, []).append((r, age))
        stalled, newly = [], []
        for name, seen in ages.items():
            age = max(a for _, a in seen)
            missing = [self.ranks[r] for r in active if r not in {x for x, _ in seen}]
            if not missing:
                continue
            what = (f"{name} waited {age:.0f} s for rank(s) {missing} (submitted "
                    f"by {[self.ranks[r] for r, _ in seen]})")
            shut = self._stall_shutdown > 0 and age > self._stall_shutdown
            if shut:
                stalled.append(what)
            if (shut or self._stall_warn > 0 and age > self._stall_warn) and \
                    name not in self._warned:
                self._warned.add(name)
                newly.append(what)
        if newly:  # every member: the doctor compares their queued names
            path = stall_record.write(self.ranks, list(mine.values()),
                                      "horovod stall: " + "; ".join(newly[:4]))
            if self.comm.rank == 0:
                log.warning("gradsync.horovod: stalled: %s%s",
                            "; ".join(newly[:4]), "" if path is None else
                            " (python -m gradsync.doctor %s)" % gs.flight_record_dir())
        if not stalled:
            return False
        why = ("; ".join(stalled[:4]) + ": HOROVOD_STALL_SHUTDOWN_TIME_SECONDS passed; every "
               "queued operation fails on every rank, which then carry on in step")
        with self._cv:
            for kind in {k for c in all_counters for k in c}:
                self._counters[kind] = max(c.get(kind, 0) for c in all_counters)
        for call in mine.values():
            self._finish(call, error=HorovodInternalError(f"{call}: {why}"))
        return True

    def _pause(self, nqueued):
        """No progress this round: wait a little (or until this rank queues
        more) before the next one."""
        with self._cv:
            if self._closed is None and \
                    sum(1 for c in self._queue if c.state == _QUEUED) == nqueued:
                self._cv.wait(0.002)


def _translate(exc, call):
    """Horovod raises HorovodInternalError (a RuntimeError) for collectives
    that fail across ranks; argument errors found on this rank keep their
    own class (ValueError, TypeError)."""
    if isinstance(exc, gs.MismatchError) and not isinstance(exc, MismatchError):
        err = MismatchError(f"{call}: the ranks' operations of this name differ: {exc}",
                            exc.status)
        err.__cause__ = exc
        return err
    if isinstance(exc, gs.Error) and not isinstance(exc, (ValueError, TypeError)):
        err = HorovodInternalError(f"{call}: {exc}")
        err.__cause__ = exc
        return err
    return exc


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
