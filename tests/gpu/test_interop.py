"""gradsync with torch, CuPy and pycuda on a real GPU: streams (issue 13).

What test_device_arrays.py does not already cover, each on the current
(default) stream and on a non-default one, with the non-default stream kept
busy first (gpu_util.spin_*) so that a missing ordering gives a wrong value
and a hidden host synchronization shows:

- the gradient kernels on a torch side stream run on that stream, after the
  work queued there, and return before the GPU has run them;
- Request.wait() under a torch side stream makes that stream (and only it)
  wait for the collective; the results are right once the stream syncs;
  wait(stream=) hands off to any stream;
- a DeviceArray still being written by an asynchronous collective hands
  that work to torch.from_dlpack's stream; gradsync results are zero-copy
  torch tensors on a side stream too;
- CuPy: round trips through DLPack and __cuda_array_interface__ on a
  blocking and a non-blocking stream (the interface's 'stream' becomes the
  kernels' stream);
- pycuda (when importable): round trips on its default and a created stream.

Every rank makes the same calls; checks sit in collectively() blocks. These
need torch or CuPy built with CUDA; elsewhere they skip.
"""
import numpy as np
import pytest
from gpu_util import spin_cupy, spin_torch
from mpi4py import MPI

import gradsync as gs
from gsutil import BF16, collectively

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
N = 1 << 20


def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def cupy_cuda():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy sees no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CuPy cannot use CUDA: {exc}")
    return cupy


@pytest.fixture
def tdev(device):
    if device == "cpu":
        pytest.skip("needs a GPU (GRADSYNC_GPU_TESTS_ON_HOST=1)")
    torch = torch_cuda()
    return torch, torch.device("cuda", device)


def warm_kernels(torch, dev):
    """gradsync's first kernel call on a device sets it up (which may
    synchronize); later calls must not."""
    t = torch.ones(8, device=dev)
    gs.accumulate_(t, t.to(torch.bfloat16))
    gs.scale_(t, 1.0)
    gs.zero_(t)
    torch.cuda.synchronize(dev)


# ------------------------------------------------------------ torch streams

@pytest.mark.parametrize("side", [False, True], ids=["current-stream", "side-stream"])
def test_torch_kernels_run_on_the_current_stream(tdev, side):
    torch, dev = tdev
    warm_kernels(torch, dev)
    s = torch.cuda.Stream(device=dev) if side else torch.cuda.current_stream(dev)
    t = torch.empty(N, device=dev)
    g = torch.full((N,), 0.5, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize(dev)
    with collectively():
        spin_torch(torch, s)
        with torch.cuda.stream(s):
            t.fill_(2.0)               # queued behind the spin
            gs.accumulate_(t, g)       # 2.5
            gs.scale_(t, 4.0)          # 10
            host_was_free = not s.query()
            after = t * 1.0            # the stream's next op sees the kernels' result
            gs.zero_(t)
            zeroed = t + 3.0
        s.synchronize()
        assert host_was_free, "a gradient kernel waited on the host for the stream"
        assert bool((after == 10.0).all()), after[:4]
        assert bool((zeroed == 3.0).all()) and not bool(t.any())
        with torch.cuda.stream(s):
            assert gs.all_finite([t, g]) is True   # a host answer: it waits, and is right


def test_request_wait_makes_the_current_stream_wait(comm, tdev):
    torch, dev = tdev
    s = torch.cuda.Stream(device=dev)
    x = torch.zeros(N, device=dev)
    comm.allreduce_(x)  # the device path is up, and the asynchronous one
    comm.allreduce_async_(x).synchronize()
    torch.cuda.synchronize(dev)
    with collectively():
        spin_torch(torch, s)
        with torch.cuda.stream(s):
            x.fill_(float(comm.rank + 1))
            req = comm.allreduce_async_(x)
            got = req.wait()
            host_was_free = not s.query()
            legacy_idle = torch.cuda.default_stream(dev).query()
            y = x * 2.0  # on s: after the collective
        s.synchronize()
        total = comm.size * (comm.size + 1) / 2
        assert got is x
        assert bool((y == 2 * total).all()), (y[:4], total)
        if comm.device_transport == "nccl":  # device work from start to end
            assert host_was_free, "Request.wait() blocked the host on the NCCL path"
            assert legacy_idle, "the legacy default stream was made to wait, not torch's"
        req.synchronize()
        assert req.done


def test_request_wait_on_a_named_stream(comm, tdev):
    torch, dev = tdev
    s, other = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
    x = torch.zeros(4099, device=dev)
    torch.cuda.synchronize(dev)
    with collectively():
        spin_torch(torch, s)
        with torch.cuda.stream(s):
            x.fill_(float(comm.rank))
            req = comm.allreduce_async_(x, op="max")
        req.wait(stream=other.cuda_stream)
        with torch.cuda.stream(other):
            y = x + 1.0
        other.synchronize()
        assert bool((y == comm.size).all()), y[:4]
        req.synchronize()


def test_pending_device_array_goes_to_torch_on_its_stream(comm, tdev):
    """torch.from_dlpack passes its current stream; gradsync makes that
    stream wait for the collective still writing the array."""
    torch, dev = tdev
    s = torch.cuda.Stream(device=dev)
    a = gs.to_device(np.full(N, float(comm.rank + 1), np.float32), dev.index)
    comm.allreduce_(a)
    comm.allreduce_async_(a).synchronize()
    a.copy_from(np.full(N, float(comm.rank + 1), np.float32))
    torch.cuda.synchronize(dev)
    with collectively():
        # the array's producer stream is the legacy default one: keep it busy
        spin_torch(torch, torch.cuda.default_stream(dev))
        req = comm.allreduce_async_(a)
        pending_stream = a.__cuda_array_interface__["stream"]
        with torch.cuda.stream(s):
            t = torch.from_dlpack(a)
            host_was_free = not s.query()
            u = t * 1.0
        s.synchronize()
        total = comm.size * (comm.size + 1) / 2
        assert t.data_ptr() == a.ptr, "torch.from_dlpack copied"
        assert bool((u == total).all()), (u[:4], total)
        if comm.device_transport == "nccl":
            assert pending_stream is not None, "a pending array exported no stream"
            assert host_was_free, "exporting a pending array blocked the host"
        req.synchronize()
        assert a.__cuda_array_interface__["stream"] is None


def test_results_are_zero_copy_torch_tensors_on_a_side_stream(comm, tdev):
    torch, dev = tdev
    s = torch.cuda.Stream(device=dev)
    x = torch.arange(1000, dtype=torch.float32, device=dev) + comm.rank
    torch.cuda.synchronize(dev)
    with collectively():
        spin_torch(torch, s)
        with torch.cuda.stream(s):
            x.add_(1.0)                      # queued behind the spin
            out = comm.allreduce(x)          # ordered after it; a DeviceArray
            gathered = comm.allgather(x)
            t, tg = torch.from_dlpack(out), torch.from_dlpack(gathered)
            v = t * 1.0
        s.synchronize()
        base = np.arange(1000, dtype=np.float64) + 1
        want = comm.size * base + comm.size * (comm.size - 1) / 2
        assert isinstance(out, gs.DeviceArray) and t.data_ptr() == out.ptr
        assert tg.data_ptr() == gathered.ptr and tuple(tg.shape) == (1000 * comm.size,)
        np.testing.assert_array_equal(v.cpu().numpy(), want.astype(np.float32))
        for r in range(comm.size):
            np.testing.assert_array_equal(tg[1000 * r:1000 * (r + 1)].cpu().numpy(),
                                          (base + r).astype(np.float32))


def test_torch_bfloat16_through_dlpack_both_ways(tdev):
    torch, dev = tdev
    s = torch.cuda.Stream(device=dev)
    host = np.linspace(-3, 3, 999).astype(BF16)
    with collectively():
        a = gs.to_device(host, dev.index)
        with torch.cuda.stream(s):
            t = torch.from_dlpack(a)
            t.mul_(2)
            back = gs.to_device(t, "cpu")    # gradsync reads torch's tensor back
        s.synchronize()
        assert t.dtype == torch.bfloat16 and t.data_ptr() == a.ptr
        np.testing.assert_array_equal(back.numpy().view(np.int16),
                                      (host.astype(np.float32) * 2).astype(BF16).view(np.int16))


# ------------------------------------------------------------ CuPy

@pytest.fixture
def cdev(device):
    if device == "cpu":
        pytest.skip("needs a GPU (GRADSYNC_GPU_TESTS_ON_HOST=1)")
    cupy = cupy_cuda()
    with cupy.cuda.Device(device):
        yield cupy


class CAIProxy:
    """Only a __cuda_array_interface__: CuPy's, with 'stream' set."""

    def __init__(self, a, stream):
        self.a, self.stream = a, stream

    @property
    def __cuda_array_interface__(self):
        d = dict(self.a.__cuda_array_interface__)
        d["stream"] = self.stream
        return d


@pytest.mark.parametrize("kind", ["null", "blocking", "non-blocking"])
def test_cupy_round_trips_on_streams(comm, cdev, kind):
    """Kernels through DLPack (a blocking stream orders after the legacy
    stream gradsync's kernels then run on) or, on a non-blocking stream,
    through the interface with its 'stream' (the kernels run there); a
    blocking collective's result is in place on return."""
    cupy = cdev
    stream = {"null": cupy.cuda.Stream.null, "blocking": cupy.cuda.Stream(),
              "non-blocking": cupy.cuda.Stream(non_blocking=True)}[kind]
    x = cupy.zeros(N, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    with collectively():
        spin_cupy(cupy, stream)
        with stream:
            x.fill(2.0)
            arg = CAIProxy(x, stream.ptr or 1) if kind == "non-blocking" else x
            gs.scale_(arg, 3.0)
            after_kernel = x * 1
            comm.allreduce_(arg)
            after_allreduce = x + 0
        stream.synchronize()
        assert bool((after_kernel == 6.0).all()), after_kernel[:4]
        assert bool((after_allreduce == 6.0 * comm.size).all()), after_allreduce[:4]


def test_cupy_takes_gradsync_results_zero_copy_on_a_stream(comm, cdev):
    cupy = cdev
    s = cupy.cuda.Stream(non_blocking=True)
    a = gs.to_device(np.full(4096, float(comm.rank + 1), np.float32), cupy.cuda.Device().id)
    with collectively():
        out = comm.allreduce(a, op="max")
        with s:
            c = cupy.from_dlpack(out)
            d = c * 2
        s.synchronize()
        assert c.data.ptr == out.ptr
        assert bool((d == 2.0 * comm.size).all())


# ------------------------------------------------------------ pycuda

def test_pycuda_round_trips(comm, device):
    if device == "cpu":
        pytest.skip("needs a GPU (GRADSYNC_GPU_TESTS_ON_HOST=1)")
    pytest.importorskip("pycuda")
    if WORLD.allreduce(device, op=MPI.MAX) != 0:  # decided alike on every rank
        pytest.skip("pycuda.autoprimaryctx takes device 0; a rank here uses another")
    pytest.importorskip("pycuda.autoprimaryctx")  # the primary context, as CUDA runtime users
    import pycuda.driver as drv
    import pycuda.gpuarray as gpuarray
    host = np.arange(3000, dtype=np.float32) + comm.rank
    with collectively():
        a = gpuarray.to_gpu(host)
        gs.scale_(a, 2.0)                        # __cuda_array_interface__, no stream
        np.testing.assert_array_equal(a.get(), 2 * host)
        st = drv.Stream()
        b = gpuarray.to_gpu_async(host, stream=st)
        comm.allreduce_(CAIProxy(b, st.handle))  # ordered after the upload on st
        want = sum(np.arange(3000, dtype=np.float64) + r for r in range(comm.size))
        np.testing.assert_array_equal(b.get(stream=st), want.astype(np.float32))
        out = comm.allreduce(a)                  # a DeviceArray: pycuda views it zero-copy
        view = gpuarray.GPUArray(out.shape, out.dtype, gpudata=out.ptr)
        np.testing.assert_array_equal(view.get(), (2 * want).astype(np.float32))
