"""Stream semantics of the Python device layer, and the GPU path's refusals,
against the emulated CUDA runtime (its test hooks slow a stream down and ask
whether one is busy; on real hardware these tests skip, tests/gpu's others
run there):

- the gradient kernels run on the caller's work stream (the legacy default
  stream, or a CAI `stream` of the caller's own) and return without waiting
  for it or for the communicator's stream;
- a thread waiting for a collective's GPU work lets another thread's
  collective on another communicator through;
- a collective, blocking or asynchronous, follows the work queued before it
  on the caller's work stream (the communicator's stream is non-blocking: only
  the event orders it), and after a stream named by cuda_order_after;
- every communicator has a stream of its own (Communicator.cuda_stream);
- an asynchronous collective's Request.wait() hands its GPU work to the
  caller's stream (NCCL path: the host is not blocked); synchronize() waits;
- a DeviceArray that an asynchronous collective is writing exports that work:
  __cuda_array_interface__['stream'] names the stream, __dlpack__(stream=s)
  makes s wait, numpy() waits;
- a driver older than the CUDA runtime is reported with both versions; NCCL
  older than 2.14 is refused and the device path stages through MPI; no
  context is created on a device the process never used.
"""
import ctypes
import json
import os
import threading
import time

import numpy as np
import pytest

import gradsync as gs
from gsutil import collectively, run_child

try:
    _LIB = ctypes.CDLL("libgradsync.so")
    _SLEEP, _BUSY, _SYNC = _LIB.gs_emulated_sleep, _LIB.gs_emulated_busy, _LIB.gs_emulated_sync
    # reads device memory now, outside every stream's order (no race check)
    _PEEK = _LIB.gs_emulated_peek
    _PEEK.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    # a gate holds a stream busy until _RELEASE: "still busy?" is then a
    # question of order, not of how fast this machine is
    _HOLD, _RELEASE = _LIB.gs_emulated_hold, _LIB.gs_emulated_release
    _SLEEP.argtypes = [ctypes.c_size_t, ctypes.c_double]
    _HOLD.argtypes = [ctypes.c_size_t]
    _BUSY.argtypes = [ctypes.c_size_t]
    _SYNC.argtypes = [ctypes.c_size_t]
    _NEW_STREAM = _LIB.gs_emulated_stream
    _NEW_STREAM.argtypes, _NEW_STREAM.restype = [ctypes.c_int], ctypes.c_size_t
    EMULATED = True
except (OSError, AttributeError):
    EMULATED = False

pytestmark = pytest.mark.skipif(not EMULATED or gs.build_info()["cuda_devices"] == 0,
                                reason="needs the emulated CUDA runtime's test hooks")
LEGACY = 1


@pytest.fixture
def stream(comm):
    """The communicator's own stream, once its device path is up."""
    warm = gs.to_device(np.ones(4, np.float32), 0)
    comm.allreduce_(warm)
    return comm.cuda_stream


@pytest.mark.parametrize("held", ["communication stream", "default stream"])
def test_kernels_do_not_wait(stream, held):
    """The kernels queue on the caller's (default) stream and return: they
    neither wait for gradsync's communication stream nor, on the host, for
    the caller's own stream (a gate holds the one named)."""
    h = stream if held == "communication stream" else LEGACY
    x = gs.to_device(np.full(1000, 2.0, np.float32), 0)
    g = gs.to_device(np.full(1000, 0.5, np.float32), 0)
    with collectively():
        _HOLD(h)
        gs.zero_(x)
        gs.accumulate_(x, g)
        gs.scale_(x, 4.0)
        busy = bool(_BUSY(h))
        _RELEASE()
        _SYNC(h)
        assert busy, f"a gradient kernel waited on the host for the {held}"
        np.testing.assert_array_equal(x.numpy(), np.full(1000, 2.0, np.float32))


class OnStream:
    """A DeviceArray seen through __cuda_array_interface__ with `stream` as
    the caller's work stream. Taken onto that stream as a consumer takes it
    (__dlpack__(stream=...) makes the stream wait for the array's pending
    work, such as to_device's copy)."""

    def __init__(self, array, stream):
        self.array, self.stream = array, stream
        del_me = array.__dlpack__(stream=stream)
        del del_me

    @property
    def __cuda_array_interface__(self):
        return dict(self.array.__cuda_array_interface__, stream=self.stream)


@pytest.fixture
def own_stream():
    """A non-blocking stream of the caller's own: the legacy default stream
    does not wait for it, so only gradsync's ordering can."""
    s = _NEW_STREAM(1)
    assert s, "the emulated runtime made no stream"
    return s


@pytest.mark.parametrize("on", ["default stream", "CAI stream"])
@pytest.mark.parametrize("call", ["blocking", "async"])
def test_collective_follows_the_callers_stream(comm, own_stream, on, call):
    s = own_stream if on == "CAI stream" else LEGACY
    x = gs.to_device(np.full(2000, 1.0, np.float32), 0)
    g = gs.to_device(np.full(2000, 2.0, np.float32), 0)
    view = OnStream(x, s) if s != LEGACY else x
    comm.allreduce_(gs.to_device(np.ones(4, np.float32), 0))  # the device path is up
    with collectively():
        _SLEEP(s, 0.3)
        gs.accumulate_(view, g)  # queued behind the sleep: x becomes 3
        if call == "blocking":
            comm.allreduce_(view)
        else:
            comm.allreduce_async_(view).synchronize()
        np.testing.assert_array_equal(x.numpy(), np.full(2000, 3.0 * comm.size, np.float32))


def peek(array):
    """What a device array's memory holds now, whatever is queued on it."""
    out = np.empty(array.shape, array.dtype)
    assert _PEEK(out.ctypes.data, array.ptr, out.nbytes) == 0
    return out


def test_kernels_run_on_the_callers_cai_stream(comm, own_stream):
    x = gs.to_device(np.full(1000, 2.0, np.float32), 0)
    _SYNC(LEGACY)  # its copy has landed: peek() below looks outside every stream's order
    with collectively():
        _HOLD(own_stream)
        gs.scale_(OnStream(x, own_stream), 3.0)
        gs.accumulate_(OnStream(x, own_stream), OnStream(x, own_stream))  # x = 12
        busy = bool(_BUSY(own_stream))
        before = peek(x)  # (x.numpy() would race the kernels: they wrote through views)
        _RELEASE()
        _SYNC(own_stream)
        assert busy, "a gradient kernel waited on the host for the caller's stream"
        np.testing.assert_array_equal(before, np.full(1000, 2.0, np.float32),
                                      err_msg="the kernels' result showed while their stream "
                                      "was held: they ran elsewhere")
        np.testing.assert_array_equal(x.numpy(), np.full(1000, 12.0, np.float32))


def test_each_communicator_has_its_own_stream(comm, stream):
    """Communicator.cuda_stream: None before the communicator's first
    collective on CUDA memory, then a stream of its own, the one its
    collectives run on (on NCCL, a gate there holds them while the host goes
    on; the staged path's host part waits for the stream itself)."""
    other = gs.Communicator()
    try:
        with collectively():
            before = other.cuda_stream
            other.allreduce_(gs.to_device(np.ones(4, np.float32), 0))
            mine = other.cuda_stream
            nccl = other.device_transport == "nccl" and comm.size > 1
            x = gs.to_device(np.ones(64, np.float32), 0)
            if nccl:
                _HOLD(mine)
            req = other.allreduce_async_(x)
            req.wait()
            held = bool(_BUSY(mine))
            _RELEASE()
            req.synchronize()
            assert before is None, before
            assert mine not in (None, stream), (mine, stream)
            assert held or not nccl, "the collective did not run on the communicator's stream"
            np.testing.assert_array_equal(x.numpy(), np.full(64, comm.size, np.float32))
    finally:
        other.close()


def test_cuda_order_after(comm, stream, own_stream):
    """Communicator.cuda_order_after(s): later collectives, issued from the
    default stream (which does not wait for s), see what s wrote."""
    x = gs.to_device(np.full(2000, 1.0, np.float32), 0)
    g = gs.to_device(np.full(2000, 2.0, np.float32), 0)
    nccl = comm.device_transport == "nccl"  # else the host part waits for the stream
    with collectively():
        _HOLD(own_stream) if nccl else _SLEEP(own_stream, 0.3)
        gs.accumulate_(OnStream(x, own_stream), g)  # behind it: x becomes 3
        comm.cuda_order_after(own_stream)
        req = comm.allreduce_async_(x)
        req.wait()
        _RELEASE()
        req.synchronize()
        _SYNC(own_stream)
        np.testing.assert_array_equal(x.numpy(), np.full(2000, 3.0 * comm.size, np.float32))


def test_a_device_wait_lets_another_thread_in(comm, stream):
    if comm.size < 2:
        pytest.skip("one rank reduces nothing: there is no GPU work to wait for")
    other = gs.Communicator()
    x = gs.to_device(np.full(500, 1.0, np.float32), 0)
    host = np.full(10, float(comm.rank + 1))
    waiter_started = threading.Event()
    errors = []

    def wait_on_the_gpu():
        waiter_started.set()
        try:
            comm.allreduce_(x)  # its GPU work queues behind the gate
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        with collectively():
            _HOLD(stream)
            t = threading.Thread(target=wait_on_the_gpu)
            t.start()
            waiter_started.wait()
            time.sleep(0.2)  # into its wait (were it not, this test could only pass)
            other.allreduce_(host)  # needs the runtime lock the waiter polls with
            gate_closed = bool(_BUSY(stream))
            _RELEASE()
            t.join()
            assert not errors, errors
            assert gate_closed, ("a collective on another communicator had to wait until the "
                                 "GPU work the first thread waits for was done")
            np.testing.assert_array_equal(host, np.full(10, comm.size * (comm.size + 1) / 2))
            np.testing.assert_array_equal(x.numpy(), np.full(500, comm.size, np.float32))
    finally:
        other.close()


def test_request_wait_hands_off_to_the_stream(comm, stream):
    x = gs.to_device(np.full(3000, 1.0, np.float32), 0)
    nccl = comm.device_transport == "nccl"  # device work from start to end
    with collectively():
        # the staged path's host part waits for the stream itself: a gate
        # would only time out there
        _HOLD(stream) if nccl else _SLEEP(stream, 0.5)
        req = comm.allreduce_async_(x)
        assert req.wait() is x
        busy_after_wait = bool(_BUSY(stream))
        _RELEASE()
        _SYNC(LEGACY)  # the caller's stream waited for the collective
        busy_after_sync = bool(_BUSY(stream))
        if nccl:
            assert busy_after_wait, "Request.wait() blocked the host on the NCCL path"
        assert not busy_after_sync, "the caller's stream did not wait for the collective"
        np.testing.assert_array_equal(x.numpy(), np.full(3000, comm.size, np.float32))
        req.synchronize()
        assert req.done


def test_request_synchronize_waits_on_the_host(comm, stream):
    x = gs.to_device(np.full(100, 3.0, np.float32), 0)
    with collectively():
        _SLEEP(stream, 0.3)
        req = comm.allreduce_async_(x, op="max")
        req.synchronize()
        assert not _BUSY(stream), "synchronize() returned before the GPU work ended"
        assert req.done and req.stream() is None


def test_pending_device_array_exports_its_work(comm, stream):
    x = gs.to_device(np.full(500, 2.0, np.float32), 0)
    nccl = comm.device_transport == "nccl"
    with collectively():
        _HOLD(stream) if nccl else _SLEEP(stream, 0.5)
        req = comm.allreduce_async_(x)
        cai_stream = x.__cuda_array_interface__["stream"]
        capsule = x.__dlpack__(stream=LEGACY)
        _RELEASE()
        if nccl:
            assert cai_stream == stream, (cai_stream, stream)
        assert capsule is not None
        _SYNC(LEGACY)  # the consumer's stream waited for the collective
        assert not _BUSY(stream)
        np.testing.assert_array_equal(x.numpy(), np.full(500, 2.0 * comm.size, np.float32))
        req.synchronize()
        assert x.__cuda_array_interface__["stream"] is None


def test_numpy_waits_for_pending_work(comm, stream):
    x = gs.to_device(np.full(700, 1.5, np.float32), 0)
    with collectively():
        _SLEEP(stream, 0.3)
        req = comm.allreduce_async_(x)
        np.testing.assert_array_equal(x.numpy(), np.full(700, 1.5 * comm.size, np.float32))
        req.synchronize()


def test_misaligned_device_memory_is_refused(comm):
    x = gs.to_device(np.ones(64, np.float32), 0)

    class Shifted:  # the same memory two bytes in: misaligned for float32
        __cuda_array_interface__ = {"shape": (16,), "typestr": "<f4",
                                    "data": (x.ptr + 2, False), "version": 3}

    with collectively():
        with pytest.raises(ValueError, match="aligned"):
            comm.allreduce_(Shifted())
        comm.allreduce_(x)  # still usable
        np.testing.assert_array_equal(x.numpy(), np.full(64, comm.size, np.float32))


_INFO = "import gradsync as gs, json; print(json.dumps(gs.build_info()))"


def _emulated_env(**extra):
    env = {"LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_old_driver_is_reported_with_both_versions():
    p = run_child(_INFO, _emulated_env(GS_EMU_DRIVER_VERSION=12040))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["cuda_devices"] == 0
    assert "12.4" in info["cuda_error"] and "13.0" in info["cuda_error"], info["cuda_error"]


def test_nccl_older_than_2_14_is_refused():
    script = ("import gradsync as gs, numpy as np; c = gs.Communicator(); "
              "x = gs.to_device(np.ones(8, np.float32), 0); c.allreduce_(x); "
              "print(gs.build_info()['nccl'], c.device_transport)")
    path = os.path.join(os.environ.get("LD_LIBRARY_PATH", "").split(":")[0], "libgradsync.so")
    env = _emulated_env(GS_EMU_NCCL_VERSION=21300, GS_EMU_DISTINCT_GPUS=1,
                        GRADSYNC_NCCL_LIBRARY=path)
    p = run_child(script, env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["None", "mpi-staged"], p.stdout


def test_no_context_on_a_device_never_used():
    """Not by collectives, kernels, pinned memory, nor by asking where a
    __cuda_array_interface__ pointer lives: calls that name no device go to
    a context the process has (device 1's), never create device 0's."""
    script = """
import ctypes, numpy as np, gradsync as gs
lib = ctypes.CDLL("libgradsync.so")
c = gs.Communicator()
x = gs.to_device(np.ones(100, np.float32), 1)
c.allreduce_(x)
c.allreduce_async_(x, op="max").synchronize()
r = c.allreduce_async_(x); r.wait(); r.synchronize()
gs.scale_(x, 2.0)
pinned = gs.DeviceArray((8,), np.float32, "cuda_host")
gs.scale_(pinned, 2.0)
del pinned
class View:
    __cuda_array_interface__ = dict(x.__cuda_array_interface__, stream=None)
gs.scale_(View(), 0.5)
print(lib.gs_emulated_context_created(0), lib.gs_emulated_context_created(1))
"""
    p = run_child(script, _emulated_env(GS_EMU_DEVICES=2))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "1"], f"contexts created (device 0, 1): {p.stdout}"
