"""gradsync on CUDA memory (issue 5): DeviceArray and DLPack / CUDA array
interface round trips with torch and CuPy (zero-copy: same pointers), streams,
every kernel against the CPU implementation on the same inputs (bitwise), the
collectives on device arrays against float64 references at any rank count
(NCCL at one rank; ranks sharing a GPU take the MPI device path), and Adasum
on device against the CPU Adasum.

One array-backend abstraction runs the collective tests on DeviceArray, torch
CUDA tensors, CuPy arrays and a bare __cuda_array_interface__ object. Every
rank makes the same calls; bodies sit in collectively() blocks."""

import os

import kernel_reference as kr
import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import (
    ALL_DTYPES,
    BF16,
    FLOAT_DTYPES,
    INT_DTYPES,
    check_result,
    collectively,
    is_int,
    reduce_reference,
    reduce_tolerance,
)

pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

WORLD = MPI.COMM_WORLD
ON_HOST = os.environ.get("GRADSYNC_GPU_TESTS_ON_HOST", "") == "1"  # see conftest.py
CUDA_DEVICES = gs.build_info()["cuda_devices"]


def needs_gpu():
    if ON_HOST:
        pytest.skip("needs a GPU (GRADSYNC_GPU_TESTS_ON_HOST=1)")


def torch_or_skip():
    needs_gpu()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def cupy_or_skip():
    needs_gpu()
    return pytest.importorskip("cupy")


# ------------------------------------------------------------------ backends

class CAIOnly:
    """Nothing but __cuda_array_interface__ (over a DeviceArray it keeps)."""

    def __init__(self, array, readonly=False, stream=None):
        self.array = array
        self.readonly = readonly
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        d = dict(self.array.__cuda_array_interface__)
        d["data"] = (d["data"][0], self.readonly)
        d["stream"] = self.stream
        return d


class Backend:
    """Device arrays of one library: made from NumPy, read back to NumPy."""

    name = "gradsync"

    def __init__(self, device):
        self.device = device

    def to_dev(self, x):
        return gs.to_device(np.ascontiguousarray(x), self.device)

    def to_host(self, a):
        return a.numpy()

    def ptr(self, a):
        return a.ptr

    def supports(self, dtype):
        return True


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device):
        super().__init__(device)
        self.torch = torch_or_skip()
        self.dev = self.torch.device("cuda", device)

    def to_dev(self, x):
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return self.torch.from_numpy(x.view(np.int16)).view(self.torch.bfloat16).to(self.dev)
        return self.torch.from_numpy(x).to(self.dev)

    def to_host(self, t):
        if isinstance(t, gs.DeviceArray):
            return t.numpy()
        t = t.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(BF16)
        return t.numpy()

    def ptr(self, t):
        return t.data_ptr()


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self, device):
        super().__init__(device)
        self.cupy = cupy_or_skip()

    def to_dev(self, x):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.asarray(np.ascontiguousarray(x))

    def to_host(self, a):
        return a.numpy() if isinstance(a, gs.DeviceArray) else self.cupy.asnumpy(a)

    def ptr(self, a):
        return a.data.ptr

    def supports(self, dtype):
        return np.dtype(dtype) != BF16


class CAIBackend(Backend):
    name = "cai"

    def __init__(self, device):
        needs_gpu()
        super().__init__(device)

    def to_dev(self, x):
        return CAIOnly(gs.to_device(np.ascontiguousarray(x), self.device))

    def to_host(self, a):
        return a.numpy() if isinstance(a, gs.DeviceArray) else a.array.numpy()

    def ptr(self, a):
        return a.array.ptr


BACKENDS = {"gradsync": Backend, "torch": TorchBackend, "cupy": CupyBackend,
            "cai": CAIBackend}


@pytest.fixture(params=list(BACKENDS))
def backend(request, device):
    return BACKENDS[request.param](device)


def on_device(out, device):
    """An out-of-place result must be a DeviceArray where the inputs were
    (host inputs: a NumPy array, as docs/GUIDE.md section 2.1 says)."""
    if device == "cpu":
        assert isinstance(out, np.ndarray), type(out)
        return
    assert isinstance(out, gs.DeviceArray), type(out)
    assert out.device == (2, device), (out.device, device)


def to_numpy(a):
    return a.numpy() if isinstance(a, gs.DeviceArray) else np.asarray(a)


# ------------------------------------------------------------------ basics

def test_build_info_reports_cuda():
    needs_gpu()
    with collectively():
        info = gs.build_info()
        assert info["cuda"] and info["cuda_archs"] and info["cuda_devices"] == CUDA_DEVICES >= 1


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_device_array_round_trip(dtype, device):
    with collectively():
        x = kr.random_floats(np.random.default_rng(1), 37, dtype, "bits") \
            if dtype in FLOAT_DTYPES else np.arange(37).astype(dtype)
        a = gs.to_device(x, device)
        assert a.shape == (37,) and a.dtype == np.dtype(dtype) and a.nbytes == x.nbytes
        assert a.numpy().tobytes() == x.tobytes()
        b = gs.DeviceArray((37,), dtype, device).copy_from(a)  # device to device
        assert b.numpy().tobytes() == x.tobytes() and b.ptr != a.ptr
        if device != "cpu":
            assert a.device == (2, device) and a.__dlpack_device__() == (2, device)
            cai = a.__cuda_array_interface__
            assert cai["version"] == 3 and cai["data"] == (a.ptr, False)
            assert cai["shape"] == (37,) and cai["strides"] is None and cai["stream"] is None
            if np.dtype(dtype) == BF16:
                assert cai["typestr"] == "<V2" and cai["descr"] == [("bfloat16", "<V2")]
            else:
                assert cai["typestr"] == np.dtype(dtype).str
            c = gs.to_device(CAIOnly(a), "cpu")  # gradsync reads its own interface
            assert c.numpy().tobytes() == x.tobytes()


def test_device_array_exports(device):
    needs_gpu()
    with collectively():
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        a = gs.to_device(x, device)
        for mv in (None, (1, 0)):
            cap = a.__dlpack__(max_version=mv, stream=1)
            assert ("versioned" in repr(cap)) == (mv is not None)
            del cap
        for stream in (None, -1, 1, 2):
            del_me = a.__dlpack__(stream=stream)
            del del_me
        with pytest.raises(ValueError):
            a.__dlpack__(stream=0)
        host = np.from_dlpack(_Fixed(a, dl_device=(1, 0)))  # copied to the host
        assert np.array_equal(host, x) and host.ctypes.data != a.ptr
        with pytest.raises(BufferError):
            a.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)
        pinned = gs.to_device(x, "cuda_host")
        assert pinned.device == (3, 0)
        view = np.from_dlpack(pinned)  # pinned memory is host memory
        assert view.ctypes.data == pinned.ptr and np.array_equal(view, x)
        assert not hasattr(pinned, "__cuda_array_interface__")
        gs.scale_(pinned, 2.0)
        assert np.array_equal(view, 2 * x)


class _Fixed:
    """Asks the DeviceArray for a capsule with fixed arguments."""

    def __init__(self, a, **kwargs):
        self.a = a
        self.kwargs = kwargs

    def __dlpack_device__(self):
        return (1, 0) if "dl_device" in self.kwargs else self.a.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(max_version=(1, 0), **self.kwargs)


def test_torch_round_trip_zero_copy(device):
    torch = torch_or_skip()
    with collectively():
        a = gs.to_device(np.arange(10, dtype=np.float32), device)
        t = torch.from_dlpack(a)
        assert t.data_ptr() == a.ptr and t.device == torch.device("cuda", device)
        t.mul_(3)
        torch.cuda.synchronize()
        assert np.array_equal(a.numpy(), 3 * np.arange(10, dtype=np.float32))
        u = torch.as_tensor(a, device=t.device)  # through __cuda_array_interface__
        assert u.data_ptr() == a.ptr
        b = gs.to_device(np.ones(4, BF16), device)
        tb = torch.from_dlpack(b)
        assert tb.dtype == torch.bfloat16 and tb.data_ptr() == b.ptr
        # torch tensors go into gradsync calls zero-copy
        z = torch.arange(8, dtype=torch.float16, device=t.device)
        ptr = z.data_ptr()
        gs.scale_(z, 2.0)
        assert z.data_ptr() == ptr and torch.equal(z.cpu(), torch.arange(8).half() * 2)


def test_cupy_round_trip_zero_copy(device):
    cupy = cupy_or_skip()
    with collectively():
        a = gs.to_device(np.arange(10, dtype=np.float64), device)
        c = cupy.from_dlpack(a)
        assert c.data.ptr == a.ptr
        d = cupy.asarray(a)  # __cuda_array_interface__
        assert d.data.ptr == a.ptr
        c *= 2
        cupy.cuda.runtime.deviceSynchronize()
        assert np.array_equal(a.numpy(), 2 * np.arange(10.0))
        with cupy.cuda.Device(device):
            x = cupy.arange(6, dtype=cupy.float32)
        gs.zero_(x)  # DLPack (CuPy prefers it over the interface)
        assert not cupy.asnumpy(x).any()
        y = cupy.ones(6, dtype=cupy.float32)
        gs.scale_(CAIOnly(gs.to_device(np.ones(3, np.float32), device)), 2.0)
        gs.accumulate_(y, cupy.ones(6, dtype=cupy.float32))
        assert np.array_equal(cupy.asnumpy(y), np.full(6, 2, np.float32))


class RecordingProducer:
    def __init__(self, inner):
        self.inner = inner
        self.streams = []

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        self.streams.append(stream)
        return self.inner.__dlpack__(stream=stream, **kwargs)


def test_non_default_stream(comm, device):
    """gradsync passes its stream to the producer, which orders it after the
    producer's current stream: work queued on a non-default torch stream is
    seen by gradsync, however long it takes."""
    torch = torch_or_skip()
    dev = torch.device("cuda", device)
    s = torch.cuda.Stream(device=dev)
    t = torch.zeros(1 << 22, device=dev)
    u = torch.zeros(1 << 22, device=dev)
    torch.cuda.synchronize()
    with collectively():
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # keeps s busy for a while
            t.fill_(2.0)
            rec = RecordingProducer(t)
            gs.scale_(rec, 3.0)
        assert all(isinstance(x, int) and x not in (0, -1) for x in rec.streams), rec.streams
        assert bool((t == 6.0).all())
    with collectively():
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)
            u.fill_(float(comm.rank + 1))
            comm.allreduce_(u)
        assert bool((u == comm.size * (comm.size + 1) / 2).all())
    with collectively():
        a = gs.to_device(np.full(16, 5.0, np.float32), device)
        with torch.cuda.stream(s):
            v = torch.from_dlpack(a)  # torch passes s; nothing to wait for
            v.add_(1)
        s.synchronize()
        assert np.array_equal(a.numpy(), np.full(16, 6.0, np.float32))


def test_cai_stream_is_honoured(device):
    torch = torch_or_skip()
    dev = torch.device("cuda", device)
    s = torch.cuda.Stream(device=dev)
    a = gs.to_device(np.zeros(1 << 22, np.float32), device)
    t = torch.from_dlpack(a)
    torch.cuda.synchronize()
    with collectively():
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)
            t.fill_(4.0)
        gs.scale_(CAIOnly(a, stream=s.cuda_stream), 0.5)
        # the kernel went on s, through a view gradsync cannot trace back to
        # `a`: the caller waits for its own stream (H200, 2026-11-26: without
        # this wait numpy() read zeros)
        s.synchronize()
        assert np.all(a.numpy() == 2.0)


def test_mixed_memory_refused(device):
    needs_gpu()
    with collectively():
        host = np.ones(4, np.float32)
        dev = gs.to_device(np.ones(4, np.float32), device)
        with pytest.raises(ValueError, match=r"tensors\[1\].*one device"):
            gs.zero_([dev, host])
        with pytest.raises(ValueError, match=r"tensors\[1\].*one device"):
            gs.scale_([host, CAIOnly(dev)], 2.0)
        assert np.all(host == 1) and np.all(dev.numpy() == 1)
        if CUDA_DEVICES > 1:
            other = gs.to_device(np.ones(4, np.float32), (device + 1) % CUDA_DEVICES)
            with pytest.raises(ValueError, match="one device"):
                gs.zero_([dev, other])


def test_readonly_cai_refused(comm, device):
    needs_gpu()
    a = gs.to_device(np.ones(4, np.float32), device)
    with collectively():
        with pytest.raises(ValueError, match="read-only"):
            comm.allreduce_(CAIOnly(a, readonly=True))
        assert np.all(a.numpy() == 1)
    with collectively():
        out = comm.allreduce(CAIOnly(a, readonly=True))
        on_device(out, device)
        assert np.all(to_numpy(out) == comm.size)


# ------------------------------------------------------------------ kernels

def random_list(rng, sizes, dtype, kind="normal"):
    return [kr.random_floats(rng, n, dtype, kind) if dtype in FLOAT_DTYPES
            else rng.integers(-100, 100, size=n).astype(dtype) for n in sizes]


SIZES = [0, 1, 7, 33, 1000, 65537, 1 << 20]


def same(got_dev, want_host, what):
    for i, (g, w) in enumerate(zip(got_dev, want_host)):
        err = kr.same_bits(g.numpy().reshape(w.shape), w)
        assert err is None, f"{what}[{i}]: {err}"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_zero_matches_cpu(dtype, device):
    with collectively():
        rng = np.random.default_rng(10)
        host = [rng.integers(0, 256, size=n * np.dtype(dtype).itemsize,
                             dtype=np.uint8).view(dtype) for n in SIZES]
        dev = [gs.to_device(h, device) for h in host]
        gs.zero_(host)
        gs.zero_(dev)
        same(dev, host, "zero_")


@pytest.mark.parametrize("kind", ["normal", "wide", "bits"])
@pytest.mark.parametrize("pair", [(a, g) for a in FLOAT_DTYPES for g in FLOAT_DTYPES],
                         ids=lambda p: f"{p[0].name}+={p[1].name}")
def test_accumulate_matches_cpu(pair, kind, device):
    acc_dt, grad_dt = pair
    with collectively():
        rng = np.random.default_rng([11, FLOAT_DTYPES.index(acc_dt), FLOAT_DTYPES.index(grad_dt)])
        acc = random_list(rng, SIZES, acc_dt, kind)
        grad = random_list(rng, SIZES, grad_dt, kind)
        near_a, near_g = kr.near_pairs(rng, 4099, acc_dt, grad_dt)
        acc.append(near_a)
        grad.append(near_g.astype(grad_dt))
        dacc = [gs.to_device(a, device) for a in acc]
        dgrad = [gs.to_device(g, device) for g in grad]
        gs.accumulate_(acc, grad)
        assert gs.accumulate_(dacc, dgrad) is dacc
        same(dacc, acc, "accumulate_")


@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_v2_mixed_list_matches_cpu(overwrite, device):
    """One call over all 16 pairs at once (one launch on the device)."""
    with collectively():
        rng = np.random.default_rng(12)
        pairs = [(a, g) for a in FLOAT_DTYPES for g in FLOAT_DTYPES]
        sizes = [int(rng.integers(0, 5000)) for _ in pairs]
        acc = [kr.random_floats(rng, n, a, "wide") for n, (a, _) in zip(sizes, pairs)]
        grad = [kr.random_floats(rng, n, g, "wide") for n, (_, g) in zip(sizes, pairs)]
        dacc = [gs.to_device(a, device) for a in acc]
        dgrad = [gs.to_device(g, device) for g in grad]
        gs.accumulate_v2_(acc, grad, overwrite=overwrite)
        ok, out = gs.accumulate_v2_(dacc, dgrad, overwrite=overwrite)
        assert ok is True and out is dacc
        same(dacc, acc, "accumulate_v2_")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_all_finite_matches_cpu(dtype, device):
    with collectively():
        rng = np.random.default_rng(13)
        host = random_list(rng, SIZES, dtype)
        dev = [gs.to_device(h, device) for h in host]
        assert gs.all_finite(dev) is gs.all_finite(host) is True
        for bad in (np.nan, np.inf, -np.inf):
            for i in (1, len(SIZES) - 1):
                j = int(rng.integers(0, SIZES[i]))
                h = host[i].copy()
                h[j] = bad
                d = list(dev)
                d[i] = gs.to_device(h, device)
                hl = list(host)
                hl[i] = h
                assert gs.all_finite(d) is gs.all_finite(hl) is False, (bad, i, j)
        bits = kr.all_patterns(dtype) if dtype.itemsize == 2 else \
            kr.random_floats(rng, 1 << 16, dtype, "bits")
        for chunk in np.array_split(bits, 64):
            assert gs.all_finite(gs.to_device(chunk, device)) is gs.all_finite(chunk)


@pytest.mark.parametrize("factor", [0.5, 3.0, 1 / 3, 1e-3, 131008.0, -0.0, 1e30])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_scale_matches_cpu(dtype, factor, device):
    with collectively():
        rng = np.random.default_rng(14)
        host = random_list(rng, SIZES, dtype, "wide")
        host.append(kr.random_floats(rng, 5000, dtype, "bits"))
        dev = [gs.to_device(h, device) for h in host]
        gs.scale_(host, factor)
        gs.scale_(dev, factor)
        same(dev, host, "scale_")


def test_kernels_on_torch_tensors(device):
    torch = torch_or_skip()
    with collectively():
        rng = np.random.default_rng(15)
        acc = kr.random_floats(rng, 10000, np.float32)
        grad = kr.random_floats(rng, 10000, BF16)
        tb = TorchBackend(device)
        tacc, tgrad = tb.to_dev(acc), tb.to_dev(grad)
        gs.accumulate_(acc, grad)
        gs.accumulate_(tacc, tgrad)
        assert kr.same_bits(tb.to_host(tacc), acc) is None
        gs.scale_(tacc, 0.25)
        gs.scale_(acc, 0.25)
        assert kr.same_bits(tb.to_host(tacc), acc) is None
        assert gs.all_finite([tacc, tgrad]) is True
        tacc[17] = float("nan")
        assert gs.all_finite([tgrad, tacc]) is False
        gs.zero_(tacc)
        assert not bool(tacc.any()) and torch.isfinite(tacc).all()


# ------------------------------------------------------------------ collectives

def rank_inputs(inputs, rank, shapes, dtype, kind):
    return inputs.arrays(rank, shapes, dtype, kind)


OP_KINDS = [("sum", "normal"), ("average", "normal"), ("min", "normal"), ("max", "normal"),
            ("prod", "prod")]
SHAPES = [(1,), (17,), (3, 300), (0,), (5000,)]


@pytest.mark.parametrize("op,kind", OP_KINDS, ids=[o for o, _ in OP_KINDS])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_allreduce(backend, dtype, op, kind, comm, small_comm, inputs):
    if not backend.supports(dtype):
        pytest.skip(f"{backend.name} has no {np.dtype(dtype).name}")
    if op == "average" and is_int(dtype):
        pytest.skip("average needs floating dtypes")
    per_rank = inputs.all_ranks(SHAPES, dtype, kind)
    refs = [reduce_reference([pr[i] for pr in per_rank], op) for i in range(len(SHAPES))]
    tols = [reduce_tolerance([pr[i] for pr in per_rank], op) for i in range(len(SHAPES))]
    for c in (comm, small_comm):
        mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
        ptrs = [backend.ptr(a) for a in mine]
        with collectively(what=f"allreduce_ {op}") as blk:
            assert c.allreduce_(mine, op=op) is mine
            got = [backend.to_host(a) for a in mine]
            assert [backend.ptr(a) for a in mine] == ptrs
            for i, g in enumerate(got):
                check_result(g.reshape(SHAPES[i]), refs[i], tols[i], dtype, SHAPES[i])
            blk.same(got)
        fresh = [backend.to_dev(a) for a in per_rank[comm.rank]]
        with collectively(what=f"allreduce {op}"):
            outs = c.allreduce(fresh, op=op)
            for i, o in enumerate(outs):
                on_device(o, backend.device)
                check_result(to_numpy(o), refs[i], tols[i], dtype, SHAPES[i])
            for f, a in zip(fresh, per_rank[comm.rank]):  # inputs unchanged
                assert backend.to_host(f).tobytes() == a.tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.int64)],
                         ids=lambda d: d.name)
def test_broadcast(backend, dtype, comm, inputs):
    if not backend.supports(dtype):
        pytest.skip(f"{backend.name} has no {np.dtype(dtype).name}")
    per_rank = inputs.all_ranks(SHAPES, dtype, "bits")
    for root in sorted({0, comm.size - 1}):
        mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
        with collectively(what=f"broadcast_ root {root}"):
            assert comm.broadcast_(mine, root=root) is mine
            for m, want in zip(mine, per_rank[root]):
                assert backend.to_host(m).tobytes() == want.tobytes()
        src = [backend.to_dev(a) for a in per_rank[comm.rank]]
        with collectively(what=f"broadcast root {root}"):
            outs = comm.broadcast(src, root=root)
            for o, s, want, orig in zip(outs, src, per_rank[root], per_rank[comm.rank]):
                on_device(o, backend.device)
                assert to_numpy(o).tobytes() == want.tobytes()
                assert backend.to_host(s).tobytes() == orig.tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.int32)],
                         ids=lambda d: d.name)
def test_allgather(backend, dtype, comm, inputs):
    rows = [r % 3 + 1 for r in range(comm.size)]  # dim 0 differs by rank
    per_rank = [inputs.arrays(r, [(rows[r], 5), (2 * rows[r],)], dtype, "bits")
                for r in range(comm.size)]
    mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
    with collectively():
        outs = comm.allgather(mine)
        for i, o in enumerate(outs):
            on_device(o, backend.device)
            want = np.concatenate([pr[i] for pr in per_rank])
            assert o.shape == want.shape and to_numpy(o).tobytes() == want.tobytes()
    with collectively():
        one = comm.allgather(mine[0])
        on_device(one, backend.device)


@pytest.mark.parametrize("op", ["sum", "average", "max"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.int32)],
                         ids=lambda d: d.name)
def test_reduce_scatter(backend, dtype, op, comm, inputs):
    if not backend.supports(dtype):
        pytest.skip(f"{backend.name} has no {np.dtype(dtype).name}")
    if op == "average" and is_int(dtype):
        pytest.skip("average needs floating dtypes")
    shapes = [(2 * comm.size + 1, 3), (comm.size,), (1, 4)]
    per_rank = inputs.all_ranks(shapes, dtype, "normal")
    mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
    with collectively():
        outs = comm.reduce_scatter(mine, op=op)
        for i, o in enumerate(outs):
            on_device(o, backend.device)
            pr = [p[i] for p in per_rank]
            first, n = gs._core.block_range(shapes[i][0], comm.size, comm.rank)
            ref = reduce_reference(pr, op)[first:first + n]
            tol = reduce_tolerance(pr, op)
            tol = tol[first:first + n] if np.ndim(tol) else tol
            check_result(to_numpy(o), ref, tol, dtype, (n,) + shapes[i][1:])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)],
                         ids=lambda d: d.name)
def test_shard_collectives(backend, dtype, comm, inputs):
    # 8 elements each: every tensor ends inside its owner's range
    shapes = [(8,) if i % 2 else (2, 4) for i in range(4 * comm.size + 3)]
    layout = gs.ShardLayout([8] * len(shapes), comm.size)
    owners = [layout.owner(i) for i in range(len(shapes))]
    per_rank = inputs.all_ranks(shapes, dtype, "normal")
    mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
    with collectively(what="allgather_shards_"):
        assert comm.allgather_shards_(mine) is mine
        for i, o in enumerate(owners):
            assert backend.to_host(mine[i]).tobytes() == per_rank[o][i].tobytes()
    mine = [backend.to_dev(a) for a in per_rank[comm.rank]]
    with collectively(what="reduce_scatter_shards_"):
        comm.reduce_scatter_shards_(mine, op="sum")
        for i, o in enumerate(owners):
            got = backend.to_host(mine[i])
            if o == comm.rank:
                pr = [p[i] for p in per_rank]
                check_result(got, reduce_reference(pr, "sum"), reduce_tolerance(pr, "sum"),
                             dtype, shapes[i])
            else:
                assert got.tobytes() == per_rank[comm.rank][i].tobytes()


def test_allreduce_large_list(comm, small_comm, device, inputs):
    """Many tensors of mixed dtypes: several fused messages on device."""
    rng = inputs.rng(tag="shapes")
    shapes = [(int(rng.integers(1, 3000)),) for _ in range(200)]
    dtypes = [FLOAT_DTYPES[i % 4] for i in range(200)]
    per_rank = [inputs.arrays(r, shapes, dtypes, "small") for r in range(comm.size)]
    for c in (comm, small_comm):
        mine = [gs.to_device(a, device) for a in per_rank[comm.rank]]
        with collectively():
            c.allreduce_(mine, op="sum")
            for i, m in enumerate(mine):
                ref = reduce_reference([pr[i] for pr in per_rank], "sum")
                check_result(m.numpy(), ref, 0.0, dtypes[i], shapes[i])


@pytest.mark.parametrize("dtype", INT_DTYPES + [np.dtype(np.float64)], ids=lambda d: d.name)
def test_torch_out_of_place_result_is_zero_copy(dtype, comm, device):
    torch = torch_or_skip()
    tb = TorchBackend(device)
    x = tb.to_dev(np.arange(6).astype(dtype))
    with collectively():
        out = comm.allreduce(x, op="max")
        on_device(out, device)
        t = torch.from_dlpack(out)
        assert t.data_ptr() == out.ptr and t.device == x.device
        assert torch.equal(t, x)


# ------------------------------------------------------------------ Adasum

@pytest.mark.parametrize("shapes", [[(1000,)], [(17,), (3, 129), (70000,), (1,)]],
                         ids=["one", "list"])
def test_adasum_on_device_matches_cpu(shapes, comm, small_comm, device, inputs):
    per_rank = inputs.all_ranks(shapes, np.float32, "normal")
    for c in (comm, small_comm):
        host = [a.copy() for a in per_rank[comm.rank]]
        dev = [gs.to_device(a, device) for a in per_rank[comm.rank]]
        with collectively():
            c.allreduce_(host, op="adasum")
        with collectively() as blk:
            c.allreduce_(dev, op="adasum")
            got = [to_numpy(d) for d in dev]
            for i, (g, h) in enumerate(zip(got, host)):
                scale = float(np.max(np.abs(h))) if h.size else 0.0
                err = float(np.max(np.abs(g.astype(np.float64) - h))) if h.size else 0.0
                assert err <= 1e-6 * scale, f"tensor {i}: max error {err} of max |x| {scale}"
            blk.same(got)  # deterministic: the same bits on every rank
