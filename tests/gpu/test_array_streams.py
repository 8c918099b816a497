"""A DeviceArray's streams (issue 30, items 3 and 4), against the emulated
CUDA runtime, whose race checks judge by order (an access not ordered after
the write or free it conflicts with is the sticky illegal-address error) and
which counts every use of a destroyed stream; gates hold a stream's work so
that "is it still pending?" is a question of order, never of time:

- a DeviceArray is allocated and freed on a stream that always exists, never
  on the work stream a previous call left on the thread (a caller's side
  stream, destroyed since), and its free follows every stream a gradsync
  call used it on;
- as a producer it hands its pending work to the consumer: to_device's copy
  (still queued on the legacy default stream when to_device returns, as it
  may be on hardware) is waited for by the stream given to __dlpack__, and
  __cuda_array_interface__['stream'] names a stream that follows it;
- one call whose arrays come on several streams follows all of them.
On real hardware these tests skip (the hooks are the emulation's).
"""
import ctypes
import gc

import numpy as np
import pytest

import gradsync as gs
from gsutil import collectively

try:
    _LIB = ctypes.CDLL("libgradsync.so")
    _HOLD, _RELEASE, _BUSY, _SYNC = (_LIB.gs_emulated_hold, _LIB.gs_emulated_release,
                                     _LIB.gs_emulated_busy, _LIB.gs_emulated_sync)
    _HOLD_UPLOADS = _LIB.gs_emulated_hold_uploads  # the next pageable upload's DMA waits
    _NEW_STREAM, _DESTROY = _LIB.gs_emulated_stream, _LIB.gs_emulated_stream_destroy
    _DEAD_USES = _LIB.gs_emulated_destroyed_stream_uses
    _READ = _LIB.gs_emulated_read  # a consumer's read of device memory on a stream
    for _f in (_HOLD, _BUSY, _SYNC, _DESTROY):
        _f.argtypes = [ctypes.c_size_t]
    _NEW_STREAM.argtypes, _NEW_STREAM.restype = [ctypes.c_int], ctypes.c_size_t
    _DEAD_USES.restype = ctypes.c_long
    _READ.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    EMULATED = True
except (OSError, AttributeError):
    EMULATED = False

pytestmark = pytest.mark.skipif(not EMULATED or gs.build_info()["cuda_devices"] == 0,
                                reason="needs the emulated CUDA runtime's test hooks")
LEGACY = 1


class OnStream:
    """A DeviceArray seen through __cuda_array_interface__ with `stream` as
    the caller's work stream, taken onto it as a consumer takes it."""

    def __init__(self, array, stream):
        self.array, self.stream = array, stream
        del_me = array.__dlpack__(stream=stream)
        del del_me

    @property
    def __cuda_array_interface__(self):
        return dict(self.array.__cuda_array_interface__, stream=self.stream)


@pytest.fixture
def side_stream():
    """A non-blocking stream of the caller's own (torch's side streams are):
    the legacy default stream does not wait for it, nor it for that one."""
    s = _NEW_STREAM(1)
    assert s, "the emulated runtime made no stream"
    return s


def read_on(stream, array):
    """A consumer's read of `array` queued on `stream`; the host copy it
    fills once the stream gets there."""
    out = np.zeros(array.shape, array.dtype)
    assert _READ(stream, out.ctypes.data, array.ptr, out.nbytes) == 0
    return out


def test_no_destroyed_stream_is_used(comm, side_stream):
    """Arrays made while a side stream was the thread's work stream (a call
    on it was the thread's last) are freed after that stream is destroyed,
    and later calls that name no stream never touch it."""
    y = gs.to_device(np.full(64, 3.0, np.float32), 0)
    with collectively():
        out = comm.allreduce(OnStream(y, side_stream))  # its result is a DeviceArray
        gs.scale_(OnStream(y, side_stream), 2.0)  # the thread's last call ran on it
        made = gs.DeviceArray((100,), np.float32, 0)
        assert _SYNC(side_stream) == 0
        assert _DESTROY(side_stream) == 0  # as torch or CuPy may destroy a side stream
        before = _DEAD_USES()
        del made, out
        gc.collect()
        fresh = gs.DeviceArray((100,), np.float32, 0)
        back = gs.to_device(np.arange(10, dtype=np.float32), 0).numpy()  # names no stream
        del fresh
        gc.collect()
        assert _DEAD_USES() == before, "a DeviceArray used a destroyed stream"
        np.testing.assert_array_equal(y.numpy(), np.full(64, 6.0, np.float32))
        np.testing.assert_array_equal(back, np.arange(10, dtype=np.float32))


def test_free_follows_a_kernel_on_another_stream(side_stream):
    """A gradient kernel still queued on a side stream writes an array that
    is then dropped, after a call on the legacy stream: the free waits for
    the kernel (freed early, the kernel would write freed memory)."""
    x = gs.to_device(np.ones(1000, np.float32), 0)
    y = gs.to_device(np.ones(10, np.float32), 0)
    z = gs.to_device(np.full(10, 5.0, np.float32), 0)
    with collectively():
        view = OnStream(y, side_stream)
        _HOLD(side_stream)
        gs.scale_([x, view], 2.0)  # the work stream is the view's: x written there, held
        gs.scale_(z, 3.0)          # then a call on the legacy default stream
        del x
        gc.collect()
        held = bool(_BUSY(side_stream))
        _RELEASE()
        assert _SYNC(side_stream) == 0, "the kernel failed: its array was freed under it"
        assert held
        np.testing.assert_array_equal(z.numpy(), np.full(10, 15.0, np.float32))


def test_dlpack_consumer_stream_waits_for_the_copy(side_stream):
    """to_device returns with its copy still queued (held here); the stream
    passed to __dlpack__ waits for it, so the consumer's read gets the
    values, not what was in the memory before."""
    host = np.arange(2000, dtype=np.float32)
    with collectively():
        _HOLD_UPLOADS()
        a = gs.to_device(host, 0)
        capsule = a.__dlpack__(stream=side_stream)
        got = read_on(side_stream, a)
        waited = bool(_BUSY(side_stream))
        _RELEASE()
        assert _SYNC(side_stream) == 0, "the consumer's read raced the copy"
        assert waited, "the consumer's stream was not made to wait for the copy"
        np.testing.assert_array_equal(got, host)
        del capsule


def test_cai_names_a_stream_while_the_copy_is_pending():
    """While to_device's copy is queued, __cuda_array_interface__ gives a
    stream (not None, "nothing to wait for") whose later work follows it;
    once done, None."""
    host = np.arange(500, dtype=np.float32) * 3
    with collectively():
        _HOLD_UPLOADS()
        a = gs.to_device(host, 0)
        stream = a.__cuda_array_interface__["stream"]
        assert stream is not None, "the copy is pending, but the interface says no stream"
        assert isinstance(stream, int) and stream > 0
        got = read_on(stream, a)  # a consumer that synchronizes on that stream
        waited = bool(_BUSY(stream))
        _RELEASE()
        assert _SYNC(stream) == 0
        assert waited
        np.testing.assert_array_equal(got, host)
        assert _SYNC(LEGACY) == 0
        assert a.__cuda_array_interface__["stream"] is None


@pytest.mark.parametrize("last", [0, 1], ids=["first-stream-last", "second-stream-last"])
def test_a_list_on_two_streams_follows_both(last):
    """Two CAI arrays on two streams, each with a write still held behind a
    gate: the call (its work stream is the last array's) follows both."""
    streams = [_NEW_STREAM(1), _NEW_STREAM(1)]
    xs = [gs.to_device(np.ones(300, np.float32), 0) for _ in streams]
    g = gs.to_device(np.full(300, 2.0, np.float32), 0)
    views = [OnStream(x, s) for x, s in zip(xs, streams)]
    with collectively():
        for s, v in zip(streams, views):
            _HOLD(s)
            gs.zero_(v)  # a write held on each stream
        order = views if last == 1 else views[::-1]
        gs.accumulate_(order, [g, g])  # x += 2 on the last array's stream
        held = [bool(_BUSY(s)) for s in streams]
        _RELEASE()
        assert [_SYNC(s) for s in streams] == [0, 0], "the call raced a held write"
        assert held == [True, True]
        for x in xs:
            np.testing.assert_array_equal(x.numpy(), np.full(300, 2.0, np.float32))
