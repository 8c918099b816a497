"""torch.distributed Work objects over gradsync requests.

A collective started with ``async_op=True`` (and every collective DDP's
reducer starts) runs on gradsync's background thread; its Work holds the
gs.Request. ``wait()`` blocks until the request is done, runs the finishing
step (copies back into tensors that went through a stand-in) and raises the
collective's error, if any. ``get_future()`` returns a torch Future that a
completion thread of this module marks done (value: the output tensors), so
DDP comm hooks and ``.then()`` callbacks run when the data is in place, as
with NCCL. Queued collectives complete in issue order, so one thread waits
for them in order; point-to-point requests complete in any order and get a
thread of their own, which drives their progress while it waits.

A collective or receive that waits past its group's timeout raises
:class:`TimeoutError` (a torch ``DistBackendError`` and a ``gs.TimeoutError``)
whose message says "Timed out", as torch's backends do.
"""
import builtins
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _TorchWork

import gradsync as gs


class TimeoutError(dist.DistBackendError, gs.TimeoutError):
    """A call on a gradsync group waited past its timeout (the group's, or the
    call's own): torch's DistBackendError (a RuntimeError) and gradsync's
    TimeoutError (a builtin TimeoutError) at once. The group is unusable
    afterwards, as gradsync leaves a communicator whose wait gave up."""


class WaitTimeout(dist.DistBackendError, builtins.TimeoutError):
    """``Work.wait(timeout)`` gave up on a call still running (the call and
    its group go on; only the wait ended)."""


def torch_error(exc, what, seconds=None):
    """The exception to raise for ``exc`` from call ``what`` (whose limit was
    ``seconds``, when known): gradsync's timeouts in torch's words ("Timed
    out waiting ...ms"); anything else as it is."""
    if isinstance(exc, gs.TimeoutError) and not isinstance(exc, TimeoutError):
        limit = f" {seconds * 1000:.0f}ms" if seconds else ""
        err = TimeoutError(f"gradsync backend: {what} Timed out waiting{limit} for the group's "
                           f"other ranks; the group is no longer usable. {exc}", exc.status)
        err.__cause__ = exc
        return err
    return exc


class _Completer:
    """One daemon thread completing Works in the order they were watched."""

    def __init__(self, name):
        self._name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def watch(self, work):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _run(self):
        while True:
            self._queue.get()._complete()


_COLLECTIVES = _Completer("gradsync-torch-futures")
_MESSAGES = _Completer("gradsync-torch-p2p-futures")


class _Failed:
    """A collective's error, as the settled future's value (see get_future)."""

    def __init__(self, exc):
        self.exc = exc


def _value_or_raise(future):
    value = future.value()
    if isinstance(value, _Failed):
        raise value.exc
    return value


def _future_devices(tensors):
    return sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)


class Work(_TorchWork):
    """A collective's handle with torch's Work semantics.

    request: a gs.Request (None: already done); result: the output tensors
    (the future's value); finish: called once after the request completes
    (None: nothing to do); p2p: a point-to-point request; source_rank: the
    group rank a receive comes from (-1: none; None: the request's
    ``source``, a receive from any source); what: the call, for errors."""

    def __init__(self, request, result, finish=None, p2p=False, source_rank=-1,
                 what="collective", limit=None):
        super().__init__()
        self._request = request
        self._result = list(result)
        self._finish = finish
        self._p2p = p2p
        self._source = source_rank
        self._source_request = request if source_rank is None else None
        self._what = what
        self._limit = limit  # the group's timeout in seconds, for the message
        self._future = None
        self._future_out = None
        self._settle = False
        self._exc = None
        self._done = request is None
        self._lock = threading.Lock()
        if self._done and finish is not None:
            self._run_finish()

    def _run_finish(self):
        try:
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # noqa: BLE001 - reported by wait() and the future
            self._exc = exc
        self._finish = None

    def _complete(self):
        """Waits for the request (once), finishes, and settles the future."""
        with self._lock:
            if not self._done:
                try:
                    self._request.wait()
                except BaseException as exc:  # noqa: BLE001 - reported by wait()/the future
                    self._exc = torch_error(exc, self._what, self._limit)
                if self._exc is None:
                    self._run_finish()
                self._request = None
                self._done = True
            future, self._settle = (self._future, False) if self._settle else (None, False)
        if future is not None:  # outside the lock: callbacks run here
            future.set_result(_Failed(self._exc) if self._exc is not None else self._result)

    def wait(self, timeout=None):
        """Blocks until done; raises the collective's error. With a positive
        ``timeout`` (timedelta or seconds), raises TimeoutError once it has
        passed with the collective still running."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is not None and seconds > 0 and not self._done:
            deadline = time.monotonic() + seconds
            while not self.is_completed():
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"gradsync backend: Work.wait of {self._what} Timed out "
                                      f"after {seconds * 1000:.0f} ms (the call goes on)")
                time.sleep(0.0005)
        self._complete()
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self):
        """torch's Future of the output tensors. Its error is a C++ error
        (the future that ``then`` makes, whose callback raises), because
        torch's own consumers read the value in C++: DDP's reducer parses it
        as tensors, and torch.futures.Future.set_exception only stores the
        exception as the value (a Python object there: DDP crashed on it)."""
        with self._lock:
            if self._future is None:
                devices = _future_devices(self._result)
                # _complete settles this one; users get the one `then` makes
                self._future = torch.futures.Future(devices=devices) if devices else \
                    torch.futures.Future()
                self._future_out = self._future.then(_value_or_raise)
                self._settle = True  # the first _complete() after this sets it, once
                pending = not self._done
            else:
                return self._future_out
        if pending:
            (_MESSAGES if self._p2p else _COLLECTIVES).watch(self)
        else:
            self._complete()
        return self._future_out

    def is_completed(self):
        if not self._done and self._request is not None:
            try:
                if self._request.test():
                    self._complete()
            except BaseException:  # noqa: BLE001 - the error is wait()'s to raise
                self._complete()
        return self._done

    def is_success(self):
        return self.is_completed() and self._exc is None

    def exception(self):
        return self._exc

    def result(self):
        self.wait()
        return self._result

    def source_rank(self):
        if self._source_request is not None:  # a receive from any source
            self.wait()
            return self._source_request.source
        return self._source

    def _source_rank(self):
        return self.source_rank()

    def synchronize(self):
        self.wait()

    def block_current_stream(self):
        self.wait()

    def __repr__(self):
        return f"<gradsync Work {'done' if self._done else 'pending'}>"


class Done(_TorchWork):
    """The Work of a call that already finished on the calling thread (every
    blocking collective): nothing to wait for, so nothing of Work's request,
    lock and future machinery is made. A small blocking collective's cost is
    a few microseconds, and a Work costs several."""

    _result = ()

    def wait(self, timeout=None):
        return True

    def get_future(self):
        devices = _future_devices(self._result)
        future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        future.set_result(self._result)
        return future

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def source_rank(self):
        return -1

    def _source_rank(self):
        return -1

    def synchronize(self):
        pass

    def block_current_stream(self):
        pass

    def __repr__(self):
        return "<gradsync Work done>"


def finished(result):
    """A Done Work whose value is the list ``result`` (no __init__ of its
    own: torch's constructor is the whole cost)."""
    work = Done()
    work._result = result
    return work


def done(result, finish=None):
    """The Work of a call that already finished on this thread, after its
    finishing step (whose error, if any, is raised here, by the call)."""
    if finish is not None:
        finish()
    return finished(list(result))
