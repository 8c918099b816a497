"""Cross-rank validation and argument errors.

Every test keeps all ranks in the same sequence of collective calls: calls
that are expected to fail sit inside ``collectively()`` blocks, so a missing
or wrong exception fails the test on every rank instead of hanging it."""


import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import check_unchanged, collective_assert, collectively, ride_bytes

pytestmark = pytest.mark.mpi

needs_two = pytest.mark.mpi(min_size=2)


def assert_still_works(comm, what="after the error"):
    x = np.arange(5, dtype=np.float32) + comm.rank
    with collectively(what=what):
        out = comm.allreduce(x, "sum")
        expected = (np.arange(5, dtype=np.float64) * comm.size
                    + sum(range(comm.size)))
        assert np.array_equal(out, expected.astype(np.float32)), out
    with collectively(what=what + " (in place)"):
        y = np.full(3, comm.rank, dtype=np.int64)
        comm.allreduce_(y, "max")
        assert np.all(y == comm.size - 1)


def expect_mismatch(call, words, inputs_before, inputs_after):
    """Run ``call`` expecting gs.MismatchError; its message must contain one
    of ``words`` and mention ranks; the inputs must be untouched."""
    with pytest.raises(gs.MismatchError) as ei:
        call()
    msg = str(ei.value).lower()
    assert any(w in msg for w in words), (
        "MismatchError message does not say what differs (%s): %r"
        % (words, str(ei.value)))
    assert "rank" in msg, (
        "MismatchError message does not name the ranks: %r" % str(ei.value))
    check_unchanged(inputs_after, inputs_before)


# ------------------------------------------------------------- mismatches

RIDE = ride_bytes()  # every rank imports this module, so all make the communicator

# payload sizes: "small" calls (<= RIDE bytes, one dtype) may travel inside
# the validation message; "large" ones do not; in "straddle" cases one rank's
# call is small and the other ranks' is not.
MISMATCH_CASES = [(w, p) for w in ("tensor_count", "dtype", "element_count",
                                   "op")
                  for p in ("small", "large", "straddle") if
                  not (w == "op" and p == "straddle")]


def mismatch_inputs(what, payload, r):
    n = {"small": 4, "large": RIDE // 4 + 250, "straddle": RIDE // 12}[payload]
    op = "sum"
    if what == "tensor_count":
        k = (3 if r == 0 else 2) if payload != "straddle" else (
            3 if r == 0 else 4)  # 12n <= RIDE < 16n bytes
        xs = [np.full(n, r, np.float32) for _ in range(k)]
        words = ["count", "number", "tensors"]
    elif what == "dtype":
        m = RIDE // 4 if payload == "straddle" else n  # RIDE vs 2 * RIDE bytes
        dt = np.float32 if r == 0 else np.float64
        xs = [np.full(4, r, np.float32), np.full(m, r, dt)]
        if payload == "straddle":
            xs = xs[1:]
        words = ["dtype", "type"]
    elif what == "element_count":
        m = (RIDE - 16) // 4 if payload == "straddle" else n + 6  # RIDE vs RIDE + 4
        xs = [np.full(4, r, np.float32),
              np.full(m if r == 0 else m + 1, r, np.float32)]
        words = ["count", "element", "numel", "size", "length"]
    else:
        xs = [np.full(n, r, np.float32)]
        op = "sum" if r == 0 else "max"
        words = ["op"]
    return xs, op, words


@needs_two
@pytest.mark.parametrize("inplace", [False, True],
                         ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("what,payload", MISMATCH_CASES,
                         ids=["%s-%s" % c for c in MISMATCH_CASES])
def test_allreduce_mismatch(what, payload, inplace, comm):
    xs, op, words = mismatch_inputs(what, payload, comm.rank)
    before = [x.copy() for x in xs]
    fn = comm.allreduce_ if inplace else comm.allreduce
    with collectively():
        expect_mismatch(lambda: fn(xs, op), words, before, xs)
    assert_still_works(comm)


@needs_two
def test_broadcast_root_mismatch(comm):
    xs = [np.full(8, comm.rank, np.int32), np.full(3, comm.rank, np.float16)]
    before = [x.copy() for x in xs]
    root = 0 if comm.rank == 0 else 1
    with collectively():
        expect_mismatch(lambda: comm.broadcast_(xs, root=root), ["root"],
                        before, xs)
    assert_still_works(comm)


@needs_two
def test_broadcast_count_mismatch(comm):
    xs = [np.full(8 + (comm.rank == 1), comm.rank, np.int32)]
    before = [x.copy() for x in xs]
    with collectively():
        expect_mismatch(lambda: comm.broadcast_(xs, root=0),
                        ["count", "element", "numel", "size", "length"],
                        before, xs)
    assert_still_works(comm)


@needs_two
def test_different_collectives_mismatch(comm):
    """Rank 0 calls allreduce_, the others broadcast_: same tensors."""
    xs = [np.full(8, comm.rank, np.float32)]
    before = [x.copy() for x in xs]
    if comm.rank == 0:
        call = lambda: comm.allreduce_(xs, "sum")  # noqa: E731
    else:
        call = lambda: comm.broadcast_(xs, root=0)  # noqa: E731
    with collectively():
        with pytest.raises(gs.MismatchError):
            call()
        check_unchanged(xs, before)
    assert_still_works(comm)


@needs_two
def test_reduce_scatter_rows_mismatch(comm):
    x = np.ones((7 + (comm.rank == comm.size - 1), 2), np.float32)
    before = [x.copy()]
    with collectively():
        expect_mismatch(lambda: comm.reduce_scatter(x, "sum"),
                        ["count", "element", "numel", "size", "length",
                         "shape", "row"], before, [x])
    assert_still_works(comm)


@needs_two
def test_allgather_trailing_shape_mismatch(comm):
    x = np.ones((2, 3 if comm.rank == 0 else 4), np.float32)
    with collectively():
        with pytest.raises((gs.MismatchError, ValueError)):
            comm.allgather(x)
    assert_still_works(comm)


@needs_two
@pytest.mark.parametrize("thresholds,n", [((4096, 8192), 10),
                                          ((4096, 8192), 5000),
                                          ((256, 4096), 100)],
                         ids=["small", "large", "straddle"])
def test_fusion_threshold_mismatch(thresholds, n, comm):
    """gs_comm.h: every rank must use the same threshold; validation checks
    it."""
    c = gs.Communicator(MPI.COMM_WORLD, fusion_threshold=thresholds[
        0 if comm.rank == 0 else 1])
    try:
        xs = [np.ones(n, np.float32)]
        with collectively():
            with pytest.raises(gs.MismatchError):
                c.allreduce_(xs)
            assert np.all(xs[0] == 1)
    finally:
        c.close()
    assert_still_works(comm)


# ------------------------------------------------- errors on one rank only

@needs_two
@pytest.mark.parametrize("m", [10, 1000], ids=["small", "large"])
@pytest.mark.parametrize("bad", ["non_contiguous", "dtype", "read_only"])
def test_error_on_one_rank_only(bad, m, comm):
    culprit = comm.size - 1 if bad == "read_only" else 0
    me_bad = comm.rank == culprit
    base = np.arange(2 * m, dtype=np.float32) + comm.rank
    good = [np.ones(5, np.float32) * comm.rank, base[:m].copy()]
    if me_bad and bad == "non_contiguous":
        xs = [good[0], base[::2]]
        expected = ValueError
    elif me_bad and bad == "dtype":
        xs = [good[0], base[:m].astype(np.complex64)]
        expected = TypeError
    elif me_bad and bad == "read_only":
        ro = base[:m].copy()
        ro.flags.writeable = False
        xs = [good[0], ro]
        expected = ValueError
    else:
        xs = good
        expected = gs.MismatchError
    before = [x.copy() for x in xs]
    with collectively():
        with pytest.raises(expected) as ei:
            comm.allreduce_(xs, "sum")
        if me_bad:
            assert not isinstance(ei.value, gs.MismatchError), (
                "the rank with the bad argument must raise its own error, "
                "got %r" % ei.value)
        check_unchanged(xs, before)
    assert_still_works(comm)


# ------------------------------------------------------------ bad arguments

def test_non_contiguous_raises_valueerror(comm):
    a = np.arange(40, dtype=np.float32).reshape(8, 5)
    cases = {"strided": [np.ones(3, np.float32), a[:, 1]],
             "fortran": [np.asfortranarray(a)],
             "transposed": [a.T]}
    for name, xs in cases.items():
        for fn in (comm.allreduce, comm.allreduce_):
            with collectively(what="%s %s" % (name, fn.__name__)):
                with pytest.raises(ValueError) as ei:
                    fn(xs)
                msg = str(ei.value).lower()
                assert "contiguous" in msg, str(ei.value)
                assert "tensor" in msg, (
                    "message should name the argument: %r" % str(ei.value))
    for name, call in (
            ("broadcast_", lambda: comm.broadcast_(a[:, 1])),
            ("allgather", lambda: comm.allgather(a[::2])),
            ("reduce_scatter", lambda: comm.reduce_scatter(a.T))):
        with collectively(what=name):
            with pytest.raises(ValueError, match="(?i)contiguous"):
                call()
    assert_still_works(comm)


def test_read_only_in_place_raises_valueerror(comm):
    ro = np.arange(6, dtype=np.float32)
    ro.flags.writeable = False
    for name, call in (("allreduce_", lambda: comm.allreduce_([ro])),
                       ("broadcast_", lambda: comm.broadcast_(ro, root=0))):
        with collectively(what=name):
            with pytest.raises(ValueError, match="(?i)read.?only|writ"):
                call()
            assert np.array_equal(ro, np.arange(6, dtype=np.float32))
    # out of place only reads its inputs: a read-only array is fine
    with collectively(what="allreduce read-only input"):
        out = comm.allreduce(ro, "sum")
        assert np.array_equal(out, np.arange(6, dtype=np.float32) * comm.size)


BAD_DTYPES = [np.complex64, np.bool_, np.uint16, np.int16, np.uint64]
if hasattr(np, "float128"):
    BAD_DTYPES.append(np.float128)


@pytest.mark.parametrize("dtype", BAD_DTYPES,
                         ids=[np.dtype(d).name for d in BAD_DTYPES])
def test_unsupported_dtype_raises_typeerror(dtype, comm):
    x = np.zeros(4, dtype=dtype)
    name = np.dtype(dtype).name
    for fn in (comm.allreduce, comm.allreduce_):
        with collectively(what=fn.__name__):
            with pytest.raises(TypeError) as ei:
                fn([np.ones(2, np.float32), x])
            assert name in str(ei.value), (
                "TypeError should name the dtype %s: %r" % (name,
                                                           str(ei.value)))
    with collectively(what="broadcast_"):
        with pytest.raises(TypeError, match=name):
            comm.broadcast_(x)
    assert_still_works(comm)


def _has_cuda():
    info = gs.build_info()
    for k in ("cuda", "cuda_version"):
        if k in info:
            return bool(info[k])
    return False


class FakeCudaDLPack:
    """Claims to live on CUDA device 0; has no data to hand out."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *args, **kwargs):
        raise BufferError("fake tensor: __dlpack__ should not be needed")


class FakeCudaArrayInterface:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                "data": (0xDEAD0000, False), "version": 3,
                                "strides": None}


@pytest.mark.parametrize("kind", ["dlpack", "cuda_array_interface"])
def test_cuda_tensor_without_cuda_build(kind, comm):
    if _has_cuda():
        pytest.skip("this build has CUDA")
    obj = FakeCudaDLPack() if kind == "dlpack" else FakeCudaArrayInterface()
    for fn in (comm.allreduce_, comm.allreduce):
        with collectively(what=fn.__name__):
            with pytest.raises((ValueError, TypeError, gs.Error)) as ei:
                fn([obj])
            assert "cuda" in str(ei.value).lower(), (
                "error should say the build has no CUDA: %r" % str(ei.value))
    assert_still_works(comm)


def test_bad_root_raises_valueerror(comm):
    x = np.ones(3, np.float32)
    for root in (-1, comm.size):
        with collectively(what="root %d" % root):
            with pytest.raises(ValueError):
                comm.broadcast_(x, root=root)
            assert np.all(x == 1)
    assert_still_works(comm)


def test_adasum_only_for_allreduce(comm):
    x = np.ones(2 * comm.size, np.float32)
    with collectively():
        with pytest.raises((ValueError, TypeError, gs.Error)):
            comm.reduce_scatter(x, "adasum")
    assert_still_works(comm)


def test_unknown_op_raises_valueerror(comm):
    x = np.ones(4, np.float32)
    for op in ("bogus", "SUMM", ""):
        with collectively(what=repr(op)):
            with pytest.raises(ValueError):
                comm.allreduce(x, op)
    with collectively(what="int op 99"):
        with pytest.raises(ValueError):
            comm.allreduce(x, 99)
    assert_still_works(comm)


def test_error_hierarchy():
    collective_assert(issubclass(gs.MismatchError, gs.Error),
                      "MismatchError must derive from gs.Error")
    collective_assert(issubclass(gs.Error, Exception), "gs.Error")
