"""The rendezvous store's side of joining singletons into one world
(gradsync._world): keys under ``gradsync/join/<generation>/``, every wait
a poll of the store against one deadline, an abort key that fails the
other ranks fast once one knows the join cannot finish, and a watch that
names a member whose process is gone."""
import queue
import threading
import time

from gradsync import _core

_POLL_SECONDS = 0.005
_WATCH_SECONDS = 0.05  # how often a join's waits ask whether a member is gone

class JoinError(_core.Error):
    """Joining singleton processes into one world failed (every rank raises it)."""


class _Rendezvous:
    """The store's side of one join: keys under ``gradsync/join/<gen>/``,
    every wait against one deadline, and an abort key that fails the others
    fast once one rank knows the join cannot finish."""

    def __init__(self, store, rank, size, timeout, generation, watch=None):
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.prefix = f"gradsync/join/{generation}/"
        self.watch = watch  # None, or a call naming a member that is gone (else None)
        self.watched = 0.0

    def key(self, name):
        return self.prefix + name

    def set(self, name, value):
        try:
            self.store.set(self.key(name), value)
        except Exception as e:  # noqa: BLE001 (the store is the user's: any error)
            raise JoinError(self._gone(e)) from e

    def _gone(self, e):
        return (f"gradsync join: rank {self.rank} of {self.size} lost the rendezvous store "
                f"({type(e).__name__}: {e}); is the store's host (MASTER_ADDR/MASTER_PORT, "
                "rank 0 or the torchrun agent) still up?")

    def _has(self, name):
        try:
            return self.store.check([self.key(name)])
        except Exception as e:  # noqa: BLE001
            raise JoinError(self._gone(e)) from e

    def get(self, name, waiting_for):
        """The value of ``name`` once set; JoinError at the deadline (naming
        ``waiting_for`` and the ranks that never arrived) or on an abort."""
        while True:
            if self._has("abort"):  # first: a port published before an abort is stale
                raise JoinError(bytes(self.store.get(self.key("abort"))).decode())
            if self._has(name):
                return bytes(self.store.get(self.key(name)))
            now = time.monotonic()
            if now > self.deadline:
                raise JoinError(self._late(waiting_for))
            if self.watch is not None and now - self.watched > _WATCH_SECONDS:
                self.watched = now
                gone = self.watch()
                if gone:  # the join cannot finish: say so to the others too
                    message = f"gradsync join: waiting for {waiting_for}: {gone}"
                    self.abort(message)
                    raise JoinError(message)
            time.sleep(_POLL_SECONDS)

    def same_size(self, peer):
        """JoinError when rank ``peer`` was told another WORLD_SIZE."""
        theirs = int(self.get(f"arrived/{peer}", f"rank {peer}'s arrival"))
        if theirs != self.size:
            raise JoinError(f"gradsync join: WORLD_SIZE differs between ranks: rank {self.rank} "
                            f"has {self.size}, rank {peer} has {theirs}; every process must be "
                            "given the same WORLD_SIZE")

    def claim(self):
        """Counts this rank's arrival under its number (the store's atomic
        add): a second claim of one number means two jobs share this
        rendezvous (one MASTER_ADDR/MASTER_PORT, or a store file left from an
        earlier run), and every rank of either job is told to fail rather
        than be joined to the other job's processes. A store without add
        (not torch's) skips the check."""
        add = getattr(self.store, "add", None)
        if add is None:
            return
        try:
            claims = int(add(self.key(f"claimed/{self.rank}"), 1))
        except Exception as e:  # noqa: BLE001
            raise JoinError(self._gone(e)) from e
        if claims != 1:
            message = (f"gradsync join: rank {self.rank} of WORLD_SIZE={self.size} arrived "
                       f"{claims} times at one rendezvous: two jobs (or a store left from an "
                       "earlier run) share one MASTER_ADDR/MASTER_PORT or store; give each job "
                       "its own port (or store file)")
            self.abort(message)
            raise JoinError(message)

    def missing(self):
        return [r for r in range(self.size) if not self._has(f"arrived/{r}")]

    def _late(self, waiting_for):
        try:
            missing = self.missing()
        except JoinError:
            missing = None
        said = self._sizes()
        msg = (f"gradsync join: rank {self.rank} waited {self.timeout:g} s "
               f"(GRADSYNC_TIMEOUT_SECONDS or the group's timeout) for {waiting_for}")
        if missing:
            msg += (f"; rank(s) {_ranges(missing)} of WORLD_SIZE={self.size} never arrived at "
                    "the rendezvous: are all processes started, with the same MASTER_ADDR/"
                    "MASTER_PORT (or store) and WORLD_SIZE?")
        if said and len(set(said.values())) > 1:
            msg += f"; the ranks disagree on WORLD_SIZE: {said}"
        return msg

    def _sizes(self):
        said = {}
        for r in range(self.size):
            try:
                if self._has(f"arrived/{r}"):
                    said[r] = int(self.store.get(self.key(f"arrived/{r}")))
            except (JoinError, ValueError):
                pass
        return said

    def abort(self, message):
        try:
            if not self._has("abort"):
                self.store.set(self.key("abort"), message.encode())
        except JoinError:
            pass


def _ranges(ranks):
    """[0, 1, 2, 5] as "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(out)


class BoundedStore:
    """A rendezvous store whose every call ends within ``seconds``: a store
    across a network that went down (a host cut off) can block a call for
    as long as TCP retransmits (minutes), which no store timeout bounds.
    The calls run on one daemon thread of its own; one that does not answer
    in time raises JoinError, and so does every later call (the thread may
    still be blocked in the store)."""

    def __init__(self, store, seconds):
        self.store, self.seconds = store, float(seconds)
        self._requests = queue.SimpleQueue()
        self._stuck = None
        self._thread = None
        for optional in ("add", "compare_set"):  # what the store lacks, this one lacks
            if not callable(getattr(store, optional, None)):
                setattr(self, optional, None)

    def _serve(self):
        while True:
            call, args, box, done = self._requests.get()
            try:
                box.append((True, call(*args)))
            except BaseException as e:  # noqa: BLE001 (the caller's thread raises it)
                box.append((False, e))
            done.set()

    def _call(self, name, *args):
        if self._stuck:
            raise JoinError(self._stuck)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="gradsync-store",
                                            daemon=True)
            self._thread.start()
        box, done = [], threading.Event()
        self._requests.put((getattr(self.store, name), args, box, done))
        if not done.wait(self.seconds):
            self._stuck = (f"gradsync: the rendezvous store did not answer ({name}) in "
                           f"{self.seconds:g} s (GRADSYNC_TIMEOUT_SECONDS or the group's "
                           "timeout): is its host (MASTER_ADDR, rank 0 or the launcher's "
                           "agent) still reachable from this one?")
            raise JoinError(self._stuck)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def check(self, keys):
        return self._call("check", keys)

    def add(self, key, amount):
        return self._call("add", key, amount)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)
