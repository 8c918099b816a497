"""The engine's negotiation rounds (gradsync.horovod.engine's docstring,
"Negotiation"): when the ranks' operations stop meeting in order, every
member's queued names are exchanged and the names queued everywhere run,
joined ranks contributing zeros; names some ranks never submit stall,
warn, and after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS fail everywhere.
Engine runs them on its executor thread."""
import logging
import pickle
import time

import numpy as np

import gradsync as gs

from . import stall_record
from .calls import _QUEUED, STATUS_TAG, Call
from .errors import HorovodInternalError, JoinedError, MismatchError, _Abandoned, _translate

log = logging.getLogger("gradsync.horovod")

_JOIN_REPLAYABLE = ("allreduce", "barrier")


class NegotiationRounds:
    """The rounds, a base class of Engine: they read and change its state
    (queue, names, counters, communicator) and run its _execute, _finish
    and _consume_name, on its executor thread."""

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
                with gs.call_options(tag=STATUS_TAG):
                    self.comm.allreduce_(vec, op="max")
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
        gs.flight_use_site(-1)  # the round's own collectives have no user line
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
        kind, args, specs, tag = by_rank[ref][name][1]
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
            arrays = [self.zeros(d, s) for d, s in specs]
            call = Call(kind, arrays, dict(args), name, tag, None, None, False)
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
