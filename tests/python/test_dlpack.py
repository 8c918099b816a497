"""Arrays that are not NumPy arrays (docs/GUIDE.md section 2.1), without a GPU:
gradsync.DeviceArray in host memory as a DLPack producer, gradsync as a DLPack
consumer of host tensors (versioned and legacy capsules, read-only, copies,
strides, dtypes, deleters), torch CPU tensors zero-copy, and how CUDA inputs
fail cleanly when this process sees no CUDA device. tests/gpu covers the same
on a GPU.

Every test makes the same calls on every rank; bodies sit in collectively()
blocks so a failure on one rank fails all of them together."""

import gc
import sys
import weakref

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import ALL_DTYPES, FLOAT_DTYPES, collectively, reduce_reference

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
BF16 = np.dtype(ml_dtypes.bfloat16)
INFO = gs.build_info()
NO_CUDA_DEVICE = INFO["cuda_devices"] == 0


def rank_values(rank, shape, dtype, tag=0):
    """Small integers (exact in every dtype, and in sums over a few ranks)."""
    rng = np.random.default_rng([rank, tag, 7])
    low = 0 if np.dtype(dtype).kind == "u" else -8
    return rng.integers(low, 8, size=shape, endpoint=True).astype(dtype)


def host_array(values, dtype=None):
    """A DeviceArray in host memory holding values."""
    return gs.to_device(np.asarray(values, dtype=dtype), device="cpu")


def capsule_name(capsule):
    return repr(capsule).split('"')[1]


class Producer:
    """A DLPack producer written in Python around `inner` (a NumPy array or a
    DeviceArray); records what consumers ask it for."""

    def __init__(self, inner, force_copy=False):
        self.inner = inner
        self.force_copy = force_copy
        self.calls = []

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        kwargs = {"stream": stream}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if self.force_copy:
            kwargs["copy"] = True
        return self.inner.__dlpack__(**kwargs)


class LegacyProducer:
    """A producer from before DLPack 1.0: no max_version, legacy capsules."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, stream=None):
        self.calls += 1
        return self.inner.__dlpack__(stream=stream)


class FixedCapsule:
    """Hands out one kind of capsule whatever the consumer asks for."""

    def __init__(self, inner, max_version):
        self.inner = inner
        self.max_version = max_version

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.inner.__dlpack__(max_version=self.max_version)


# ----------------------------------------------------------------- DeviceArray

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_device_array_host_basics(dtype):
    with collectively():
        values = rank_values(0, (3, 4), dtype)
        a = gs.DeviceArray((3, 4), dtype, device="cpu")
        assert a.shape == (3, 4) and a.ndim == 2 and a.size == 12
        assert a.dtype == np.dtype(dtype)
        assert a.nbytes == 12 * np.dtype(dtype).itemsize
        assert a.device == (1, 0) and a.__dlpack_device__() == (1, 0)
        assert isinstance(a.ptr, int) and a.ptr != 0
        assert "cpu" in repr(a)
        assert a.copy_from(values) is a
        got = a.numpy()
        assert isinstance(got, np.ndarray) and got.dtype == np.dtype(dtype)
        assert got.tobytes() == values.tobytes()
        b = gs.DeviceArray.from_numpy(values, device="cpu")
        assert b.numpy().tobytes() == values.tobytes() and b.ptr != a.ptr
        c = gs.to_device(a, device="cpu")  # DeviceArray to DeviceArray
        assert c.numpy().tobytes() == values.tobytes()


def test_device_array_shapes_and_arguments():
    with collectively():
        assert gs.DeviceArray(5, np.float32, "cpu").shape == (5,)
        assert gs.DeviceArray((), np.float64, "cpu").size == 1
        empty = gs.DeviceArray((0, 3), np.float16, "cpu")
        assert empty.size == 0 and empty.numpy().shape == (0, 3)
        assert gs.DeviceArray([2, 2], "float32", (1, 0)).shape == (2, 2)
        with pytest.raises(TypeError, match="int16"):
            gs.DeviceArray(3, np.int16, "cpu")
        with pytest.raises(ValueError, match="negative"):
            gs.DeviceArray((2, -1), np.float32, "cpu")
        with pytest.raises(ValueError, match="device"):
            gs.DeviceArray(2, np.float32, "tpu")
        with pytest.raises(ValueError, match="DLPack device"):
            gs.DeviceArray(2, np.float32, (8, 0))
        a = gs.DeviceArray((2, 3), np.float32, "cpu")
        with pytest.raises(ValueError, match="shape"):
            a.copy_from(np.zeros((3, 2), np.float32))
        with pytest.raises(ValueError, match="dtype"):
            a.copy_from(np.zeros((2, 3), np.float64))
        a.copy_from([[1, 2, 3], [4, 5, 6]])  # other values go through numpy.asarray
        assert a.numpy().tolist() == [[1, 2, 3], [4, 5, 6]]
        # from_numpy makes non-contiguous NumPy input contiguous
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert np.array_equal(gs.to_device(x[:, ::2], "cpu").numpy(), x[:, ::2])


def test_no_cuda_array_interface_for_host_memory():
    with collectively():
        a = gs.DeviceArray(4, np.float32, "cpu")
        assert not hasattr(a, "__cuda_array_interface__")
        with pytest.raises(AttributeError, match="host memory"):
            _ = a.__cuda_array_interface__


@pytest.mark.skipif(not NO_CUDA_DEVICE, reason="this process sees a CUDA device")
def test_cuda_device_array_without_a_device_raises():
    expected = gs.Error if INFO["cuda"] else gs.UnsupportedError
    with collectively():
        for device in (None, 0, "cuda", "cuda:0", (2, 0)):
            with pytest.raises(expected) as ei:
                gs.DeviceArray((4,), np.float32, device)
            msg = str(ei.value)
            assert "DeviceArray" in msg and "CUDA" in msg, msg
            assert ("no CUDA device" in msg) if INFO["cuda"] else ("CPU-only" in msg), msg
        with pytest.raises(expected):
            gs.to_device(np.ones(3, np.float32))
        a = gs.DeviceArray(3, np.float32, "cpu")
        with pytest.raises(expected):  # export to CUDA needs a device too
            a.__dlpack__(dl_device=(2, 0))


# ----------------------------------------------------------- DLPack producer

@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (1, 1), (2, 0)])
def test_capsule_kind_follows_max_version(max_version):
    with collectively():
        a = host_array([1.0, 2.0, 3.0], np.float32)
        cap = a.__dlpack__(max_version=max_version)
        versioned = max_version is not None and max_version[0] >= 1
        assert capsule_name(cap) == ("dltensor_versioned" if versioned else "dltensor")
        del cap


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_numpy_consumes_zero_copy(max_version):
    with collectively():
        a = host_array(np.arange(6).reshape(2, 3), np.float64)
        base = sys.getrefcount(a)
        x = np.from_dlpack(FixedCapsule(a, max_version))
        assert x.ctypes.data == a.ptr and x.shape == (2, 3) and x.dtype == np.float64
        assert sys.getrefcount(a) == base + 1  # the export holds the array
        if max_version is not None:  # NumPy imports legacy capsules read-only
            x[1, 2] = 42.0
            assert a.numpy()[1, 2] == 42.0
        y = np.from_dlpack(a)  # numpy's own request
        assert y.ctypes.data == a.ptr
        del x, y
        gc.collect()
        assert sys.getrefcount(a) == base  # each deleter ran exactly once


def test_export_keeps_the_array_alive():
    with collectively():
        a = host_array([1.0, 2.0, 3.0, 4.0], np.float32)
        ref = weakref.ref(a)
        x = np.from_dlpack(a)
        del a
        gc.collect()
        assert ref() is not None and x.tolist() == [1.0, 2.0, 3.0, 4.0]
        del x
        gc.collect()
        assert ref() is None


def test_unconsumed_capsule_releases_the_array():
    with collectively():
        a = host_array([1, 2], np.int32)
        base = sys.getrefcount(a)
        caps = [a.__dlpack__(), a.__dlpack__(max_version=(1, 0))]
        assert sys.getrefcount(a) == base + 2
        del caps
        gc.collect()
        assert sys.getrefcount(a) == base


def test_dlpack_arguments():
    with collectively():
        a = host_array([1.0, 2.0], np.float32)
        for stream in (None, -1):
            del_me = a.__dlpack__(stream=stream)
            del del_me
        with pytest.raises(ValueError, match="stream"):
            a.__dlpack__(stream=1)  # host memory takes no stream
        with pytest.raises(TypeError, match="stream"):
            a.__dlpack__(stream="default")
        same = np.from_dlpack(a, device="cpu")  # dl_device=(1, 0): no copy needed
        assert same.ctypes.data == a.ptr
        with pytest.raises(BufferError):
            a.__dlpack__(max_version=(1, 0), dl_device=(4, 0))
        copied = np.from_dlpack(Producer(a, force_copy=True))
        assert copied.ctypes.data != a.ptr and copied.tolist() == [1.0, 2.0]
        cap = a.__dlpack__(max_version=(1, 0), copy=False)
        del cap


def test_bfloat16_export_to_torch():
    torch = pytest.importorskip("torch")
    with collectively():
        values = rank_values(0, (5,), BF16)
        a = host_array(values)
        t = torch.from_dlpack(a)
        assert t.dtype == torch.bfloat16 and t.data_ptr() == a.ptr
        assert t.float().numpy().tolist() == values.astype(np.float32).tolist()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_torch_consumes_zero_copy(dtype):
    torch = pytest.importorskip("torch")
    with collectively():
        values = rank_values(1, (2, 3), dtype)
        a = host_array(values)
        base = sys.getrefcount(a)
        t = torch.from_dlpack(a)
        assert t.data_ptr() == a.ptr and tuple(t.shape) == (2, 3)
        t.zero_()
        assert not a.numpy().any()
        back = gs.to_device(t, "cpu")  # and back through gradsync's consumer
        assert not back.numpy().any()
        del t
        gc.collect()
        assert sys.getrefcount(a) == base


# ----------------------------------------------------------- DLPack consumer

@pytest.mark.parametrize("producer", ["versioned", "legacy_only", "fixed_legacy"])
def test_consumer_calls_the_deleter_once(producer, comm):
    a = host_array(rank_values(comm.rank, (16,), np.float32))
    x = np.ascontiguousarray(rank_values(comm.rank, (16,), np.float64))
    wrap = {"versioned": Producer, "legacy_only": LegacyProducer,
            "fixed_legacy": lambda inner: FixedCapsule(inner, None)}[producer]
    pa, px = wrap(a), wrap(x)
    base_a, base_x = sys.getrefcount(a), sys.getrefcount(x)
    ref = sum(rank_values(r, (16,), np.float64) for r in range(comm.size))
    if producer != "versioned":
        # a legacy capsule cannot say whether it may be written: read-only,
        # as numpy.from_dlpack takes it (docs/GUIDE.md section 2.1); the refused
        # capsules are released all the same
        with collectively():
            with pytest.raises(ValueError, match=r"tensors\[0\] is read-only: .*legacy"):
                comm.allreduce_([pa, px])
            gc.collect()
            assert sys.getrefcount(a) == base_a and sys.getrefcount(x) == base_x
            assert not np.from_dlpack(wrap(x)).flags.writeable  # NumPy's own decision
        with collectively():
            outs = comm.allreduce([pa, px])
            assert np.array_equal(outs[0], ref.astype(np.float32))
            assert np.array_equal(outs[1], ref)
            assert a.numpy().tobytes() == rank_values(comm.rank, (16,), np.float32).tobytes()
    else:
        with collectively():
            comm.allreduce_([pa, px])
    with collectively():
        gc.collect()
        assert sys.getrefcount(a) == base_a and sys.getrefcount(x) == base_x
        if producer == "versioned":
            assert [c["max_version"] for c in pa.calls] == [(1, 0)]
            assert pa.calls[0]["stream"] is None  # host memory: no stream
            assert np.array_equal(a.numpy(), ref.astype(np.float32))
            assert np.array_equal(x, ref)
        elif producer == "legacy_only":
            # one TypeError, then the legacy call, per read: once in place,
            # twice out of place (the results' shapes, then the call)
            assert pa.calls == 3


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_device_array_in_collectives(dtype, comm):
    shapes = [(7,), (3, 5)]
    mine = [rank_values(comm.rank, s, dtype, i) for i, s in enumerate(shapes)]
    per_rank = [[rank_values(r, s, dtype, i) for r in range(comm.size)]
                for i, s in enumerate(shapes)]
    arrays = [host_array(v) for v in mine]
    with collectively():
        assert comm.allreduce_(arrays) is arrays
        for a, pr in zip(arrays, per_rank):
            assert np.array_equal(a.numpy().astype(np.float64), reduce_reference(pr, "sum"))
    with collectively():
        outs = comm.allreduce([host_array(v) for v in mine], op="max")
        for o, pr in zip(outs, per_rank):
            assert isinstance(o, np.ndarray)  # host results are NumPy arrays
            assert np.array_equal(o.astype(np.float64), reduce_reference(pr, "max"))
    with collectively():
        b = host_array(mine[1])
        comm.broadcast_(b, root=comm.size - 1)
        assert b.numpy().tobytes() == per_rank[1][-1].tobytes()
    with collectively():
        src = host_array(mine[0])
        out = comm.broadcast(src, root=0)
        assert isinstance(out, np.ndarray) and out.tobytes() == per_rank[0][0].tobytes()
        assert src.numpy().tobytes() == mine[0].tobytes()
    with collectively():
        g = comm.allgather(host_array(mine[1]))
        assert isinstance(g, np.ndarray)
        assert g.tobytes() == np.concatenate(per_rank[1]).tobytes()
    with collectively():
        rs = comm.reduce_scatter(host_array(rank_values(comm.rank, (2 * comm.size + 1, 2),
                                                        dtype, 9)))
        total = reduce_reference([rank_values(r, (2 * comm.size + 1, 2), dtype, 9)
                                  for r in range(comm.size)], "sum")
        first, n = gs._core.block_range(2 * comm.size + 1, comm.size, comm.rank)
        assert isinstance(rs, np.ndarray)
        assert np.array_equal(rs.astype(np.float64), total[first:first + n])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_device_array_in_kernels(dtype):
    with collectively():
        rng = np.random.default_rng(3)
        acc = (rng.standard_normal(33) * 4).astype(np.float32).astype(dtype)
        grad = (rng.standard_normal(33) * 4).astype(np.float32).astype(BF16)
        want_acc, want_grad = acc.copy(), grad.copy()
        gs.accumulate_(want_acc, want_grad)
        da, dg = host_array(acc), host_array(grad)
        assert gs.accumulate_(da, dg) is da
        assert da.numpy().tobytes() == want_acc.tobytes()
        gs.accumulate_v2_(da, dg, overwrite=True)
        gs.accumulate_v2_(want_acc, want_grad, overwrite=True)
        assert da.numpy().tobytes() == want_acc.tobytes()
        gs.scale_([da], 0.37)
        gs.scale_([want_acc], 0.37)
        assert da.numpy().tobytes() == want_acc.tobytes()
        assert gs.all_finite([da, dg]) is True
        bad = host_array(np.array([1.0, np.inf], dtype))
        assert gs.all_finite([da, bad]) is False
        gs.zero_([da, bad])
        assert not da.numpy().any() and not bad.numpy().any()


def test_torch_cpu_tensors_zero_copy(comm):
    torch = pytest.importorskip("torch")
    t32 = torch.from_numpy(rank_values(comm.rank, (4, 6), np.float32))
    t16 = torch.from_numpy(rank_values(comm.rank, (10,), np.float32)).to(torch.bfloat16)
    ptrs = (t32.data_ptr(), t16.data_ptr())
    with collectively():
        assert comm.allreduce_([t32, t16], op="sum")[0] is t32
        ref32 = reduce_reference([rank_values(r, (4, 6), np.float32)
                                  for r in range(comm.size)], "sum")
        ref16 = reduce_reference([rank_values(r, (10,), np.float32)
                                  for r in range(comm.size)], "sum")
        assert (t32.data_ptr(), t16.data_ptr()) == ptrs
        assert np.array_equal(t32.numpy().astype(np.float64), ref32)
        assert np.array_equal(t16.float().numpy().astype(np.float64), ref16)
    with collectively():
        out = comm.allreduce(t32, op="max")  # t32 is the same on every rank now
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
        assert np.array_equal(out, t32.numpy())
    with collectively():
        g = comm.allgather([t16])
        assert g[0].dtype == BF16 and g[0].shape == (10 * comm.size,)
    with collectively():
        acc = torch.zeros(10, dtype=torch.float32)
        gs.accumulate_(acc, t16)
        assert torch.equal(acc, t16.float())
        gs.scale_(acc, 2.0)
        assert torch.equal(acc, t16.float() * 2)
        gs.zero_(acc)
        assert not acc.any()


def test_torch_through_the_c_exchange_api(comm):
    """torch.Tensor has DLPack's C exchange API (__dlpack_c_exchange_api__):
    gradsync reads tensors through it, without __dlpack__ (which refuses
    tensors that require grad)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange API")

    class NoPythonDLPack(torch.Tensor):
        def __dlpack__(self, *args, **kwargs):
            raise AssertionError("gradsync should use the C exchange API")

    p = torch.nn.Parameter(torch.full((3, 2), float(comm.rank)))
    q = torch.ones(5).as_subclass(NoPythonDLPack)
    with collectively():
        comm.broadcast_([p, q], root=comm.size - 1)
        assert torch.equal(p.detach(), torch.full((3, 2), float(comm.size - 1)))
        gs.scale_(q, 3.0)
        assert torch.equal(torch.Tensor(q), torch.full((5,), 3.0))
        out = comm.allgather(p)  # shapes come through too
        assert out.shape == (3 * comm.size, 2)


class BogusExchangeAPI:
    """Has an attribute named like the C exchange API that is not one."""

    __dlpack_c_exchange_api__ = 12345

    def __init__(self, inner):
        self.inner = inner

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.inner.__dlpack__(**kwargs)


def test_bogus_exchange_api_falls_back_to_dlpack():
    with collectively():
        x = np.ones(4, np.float32)
        gs.scale_(BogusExchangeAPI(x), 2.0)
        assert np.all(x == 2.0)


def test_readonly_dlpack_input_refused_for_writes(comm):
    x = np.arange(8, dtype=np.float32) + comm.rank
    x.flags.writeable = False
    ro = Producer(x)  # NumPy exports a 1.x capsule flagged read-only
    y = np.ones(4, np.float32)
    for fn, args, where in [
            (comm.allreduce_, ([y, ro],), "tensors[1]"),
            (comm.allreduce_, (ro,), "tensor"),
            (comm.broadcast_, ([y, ro],), "tensors[1]"),
            (gs.zero_, ([y, ro],), "tensors[1]"),
            (gs.scale_, (ro, 2.0), "tensors"),
            (gs.accumulate_, (ro, np.ones(8, np.float32)), "acc")]:
        with collectively(what=f"{fn.__name__} {where}"):
            with pytest.raises(ValueError, match="read-only") as ei:
                fn(*args)
            assert where in str(ei.value), str(ei.value)
            assert np.array_equal(y, np.ones(4, np.float32))  # nothing written
            assert np.array_equal(x, np.arange(8, dtype=np.float32) + comm.rank)
    with collectively():  # reading is fine
        assert gs.all_finite(ro)
        acc = np.zeros(8, np.float32)
        gs.accumulate_(acc, ro)
        assert np.array_equal(acc, x)
        out = comm.allreduce(ro)
        assert np.array_equal(out, sum(np.arange(8, dtype=np.float32) + r
                                       for r in range(comm.size)))


def test_copied_dlpack_input_refused_for_writes(comm):
    a = host_array(np.ones(4, np.float32))
    copied = Producer(a, force_copy=True)
    with collectively():
        with pytest.raises(ValueError, match="copy"):
            comm.allreduce_(copied)
    with collectively():
        out = comm.allreduce(copied)  # read-only use of a copy is fine
        assert np.array_equal(out, np.full(4, comm.size, np.float32))


def test_non_contiguous_dlpack_input(comm):
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    with collectively():
        with pytest.raises(ValueError, match=r"tensors\[1\] is not C-contiguous"):
            comm.allreduce_([np.ones(2, np.float32), Producer(x[:, ::2])])
    with collectively():
        with pytest.raises(ValueError, match=r"grad is not C-contiguous"):
            gs.accumulate_(np.zeros(12, np.float32), Producer(x.T))
    with collectively():
        # size-1 dimensions may carry any stride
        odd = np.lib.stride_tricks.as_strided(x, shape=(1, 6), strides=(999 * 4, 4))
        assert np.array_equal(comm.allreduce(Producer(odd)), comm.size * x[:1])


def test_non_contiguous_torch_input(comm):
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 6)
    with collectively():
        with pytest.raises(ValueError, match=r"tensor is not C-contiguous"):
            comm.allreduce_(t[:, ::2])
        assert not t.any()


@pytest.mark.parametrize("dtype", [np.int16, np.uint32, np.complex64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_unsupported_dlpack_dtype(dtype, comm):
    x = np.zeros(4, dtype)
    with collectively():
        with pytest.raises(TypeError) as ei:
            comm.allreduce_([np.ones(4, np.float32), Producer(x)])
        msg = str(ei.value)
        assert "tensors[1]" in msg and "dtype" in msg, msg
        name = {np.dtype(np.bool_): "bool"}.get(np.dtype(dtype), np.dtype(dtype).name)
        assert name in msg, msg
    with collectively():
        with pytest.raises(TypeError):
            gs.zero_(Producer(x))


def test_torch_unsupported_dtype(comm):
    torch = pytest.importorskip("torch")
    with collectively():
        with pytest.raises(TypeError, match="int16"):
            comm.allreduce_(torch.zeros(3, dtype=torch.int16))


def test_not_an_array(comm):
    with collectively():
        with pytest.raises(TypeError, match=r"tensors\[0\].*object"):
            comm.allreduce_([object()])


# -------------------------------------------- CUDA inputs without a device

class FakeCudaDLPack:
    """Claims CUDA memory; must not be asked for a capsule without a device."""

    def __init__(self):
        self.calls = 0

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        self.calls += 1
        raise BufferError("fake tensor: __dlpack__ should not be reached")


class FakeCudaArray:
    """__cuda_array_interface__ over host memory: gradsync must never write it
    (no device, so the call fails before any work)."""

    def __init__(self, target, **overrides):
        self.target = target
        self.__cuda_array_interface__ = {
            "shape": target.shape, "typestr": target.dtype.str,
            "data": (target.ctypes.data, False), "version": 3, "strides": None,
            "stream": None}
        self.__cuda_array_interface__.update(overrides)


@pytest.mark.skipif(not NO_CUDA_DEVICE, reason="this process sees a CUDA device")
def test_cuda_inputs_without_a_device_fail_cleanly(comm):
    host = np.full(4, 5.0, np.float32)
    target = np.full(4, 7.0, np.float32)
    fake_dl = FakeCudaDLPack()
    for fn, arg in [(comm.allreduce_, [host, FakeCudaArray(target)]),
                    (comm.allreduce_, [host, fake_dl]),
                    (comm.allreduce, [FakeCudaArray(target)]),
                    (comm.broadcast_, [FakeCudaArray(target)]),
                    (comm.allgather, [fake_dl]),
                    (gs.zero_, [host, FakeCudaArray(target)]),
                    (gs.scale_, [fake_dl])]:
        with collectively(what=fn.__name__):
            with pytest.raises(gs.Error) as ei:
                if fn is gs.scale_:
                    fn(arg, 2.0)
                else:
                    fn(arg)
            msg = str(ei.value)
            assert "tensors[" in msg and "cuda" in msg.lower(), msg
            assert np.all(host == 5.0) and np.all(target == 7.0)
    with collectively():
        assert fake_dl.calls == 0
        assert np.allclose(comm.allreduce_(np.ones(2, np.float32)), comm.size)  # still works


@pytest.mark.parametrize("bad, err, text", [
    ({"typestr": "<i2"}, TypeError, "'<i2'"),
    ({"typestr": ">f4"}, TypeError, "'>f4'"),
    ({"typestr": "<V2"}, TypeError, "bfloat16"),
    ({"typestr": "<V2", "descr": [("", "<V2")]}, TypeError, "bfloat16"),
    ({"strides": (8,)}, ValueError, "C-contiguous"),
    ({"mask": object()}, ValueError, "masked"),
    ({"stream": 0}, ValueError, "stream"),
    ({"data": (0, False)}, ValueError, "NULL"),
    ({"shape": None}, ValueError, "__cuda_array_interface__"),
])
def test_cuda_array_interface_checks(bad, err, text, comm):
    """Checks that need no device: all made before gradsync touches one."""
    target = np.full(4, 7.0, np.float32)
    with collectively():
        with pytest.raises(err, match=text) as ei:
            comm.allreduce_([np.ones(1, np.float32), FakeCudaArray(target, **bad)])
        assert "tensors[1]" in str(ei.value), str(ei.value)
        assert np.all(target == 7.0)
