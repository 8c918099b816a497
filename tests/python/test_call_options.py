"""gs.call_options (gs_set_call_options, issue 45 item 4): a call tag the
ranks' calls must agree on, compared with the call's other arguments, and a
per-call timeout, both the calling thread's alone and ended with the block.

References: the float64 NumPy sum of every rank's input, and the inputs'
own copies (a mismatch writes nothing)."""
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collectively

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


def _inputs(count=37):
    """Every rank's input (rank r: r + 1 + i / 8), so each rank knows the sum."""
    per_rank = [np.arange(count, dtype=np.float64) / 8 + r + 1 for r in range(WORLD.size)]
    return per_rank[WORLD.rank].copy(), np.sum(per_rank, axis=0)


@pytest.fixture
def comm():
    c = gs.Communicator(stall_seconds=0)
    yield c
    c.close()


@pytest.mark.parametrize("tag", [7, 2**64 - 1, "allreduce.grad.weight"])
def test_equal_tags_run_the_call(comm, tag):
    x, want = _inputs()
    with gs.call_options(tag=tag) as opts:
        comm.allreduce_(x)
    with collectively():
        assert np.array_equal(x, want)
        assert opts.tag is not None and 0 < opts.tag < 2**64


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "allgather", "barrier"])
def test_different_tags_fail_everywhere_and_write_nothing(comm, call):
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    x, _ = _inputs(1000)
    before = x.copy()
    tag = "name.a" if WORLD.rank == 0 else "name.b"
    raised = None
    try:
        with gs.call_options(tag=tag):
            if call == "allreduce":
                comm.allreduce_(x)
            elif call == "broadcast":
                comm.broadcast_(x, root=WORLD.size - 1)
            elif call == "allgather":
                comm.allgather(x)
            else:
                comm.barrier()
    except gs.MismatchError as exc:
        raised = exc
    with collectively():
        assert raised is not None, "different tags must fail on every rank"
        assert "call tag" in str(raised), str(raised)
        assert np.array_equal(x, before), "a mismatch wrote into the input"
    # the communicator is usable afterwards: a mismatch is an argument error
    y, want = _inputs()
    comm.allreduce_(y)
    with collectively():
        assert np.array_equal(y, want)


def test_queued_calls_carry_the_tag_they_were_queued_with(comm):
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    x, _ = _inputs()
    before = x.copy()
    with gs.call_options(tag=100 + WORLD.rank):
        req = comm.allreduce_async_(x)
    raised = None
    try:
        req.wait()  # the block ended before the background thread ran it
    except gs.MismatchError as exc:
        raised = exc
    with collectively():
        assert raised is not None and "call tag" in str(raised), raised
        assert np.array_equal(x, before)


def test_options_are_the_threads_and_end_with_the_block(comm):
    """Rank 0 holds a block with a tag of its own open on another thread
    while every main thread reduces: the tag is not the main thread's. After
    a block (nested ones included) the thread's calls carry no tag."""
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with gs.call_options(tag=12345):
            entered.set()
            leave.wait(60)

    holder = threading.Thread(target=hold) if WORLD.rank == 0 else None
    if holder:
        holder.start()
        entered.wait(60)
    try:
        x, want = _inputs()
        comm.allreduce_(x)
        with gs.call_options(tag=1 + WORLD.rank):
            with gs.call_options(timeout=30) as inner:
                inner_tag = inner.tag  # None keeps the enclosing block's tag
        y, _ = _inputs()
        comm.allreduce_(y)
        with collectively():
            assert np.array_equal(x, want)
            assert np.array_equal(y, want)
            assert inner_tag == gs.call_options(tag=1 + WORLD.rank).tag
            assert gs.call_options().tag is None and gs.call_options().timeout is None
    finally:
        leave.set()
        if holder:
            holder.join()


def test_call_timeout_ends_that_call_only():
    """The ranks but one give one allreduce 0.5 s; the last calls only once
    they gave up (marker files), so they must time out. The message names
    the call's timeout; the communicator's own timeout is unchanged, and
    another communicator's calls still run."""
    if WORLD.size < 2:
        pytest.skip("needs two ranks")
    late = WORLD.size - 1
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None, root=0)
    comm, other = gs.Communicator(stall_seconds=0), gs.Communicator(stall_seconds=0)
    before = comm.timeout
    x, want = _inputs()
    raised, waited = None, 0.0
    try:
        if WORLD.rank == late:
            deadline = time.monotonic() + 60
            while len(os.listdir(folder)) < late and time.monotonic() < deadline:
                time.sleep(0.01)
        t0 = time.monotonic()
        try:
            with gs.call_options(timeout=0.5):
                comm.allreduce_(x.copy())
        except gs.Error as exc:
            raised = exc
        waited = time.monotonic() - t0
        if WORLD.rank != late:
            open(os.path.join(folder, "gave_up.%d" % WORLD.rank), "w").close()
        # a rank either runs out of its call's 0.5 s itself or hears first
        # from one that did (the ranks sharing a host tell each other)
        own = raised is not None and "the call's timeout of 0.5 s" in str(raised)
        owners = WORLD.allreduce(int(own and WORLD.rank != late))
        with collectively():
            assert raised is not None, "the call must end in an error"
            if WORLD.rank != late:
                assert isinstance(raised, gs.TimeoutError), repr(raised)
                assert own or "gave up" in str(raised), str(raised)
                assert 0.45 <= waited < 30, waited  # nobody gives up before 0.5 s
            assert owners >= 1, "no rank's message names the call's timeout"
            assert comm.timeout == before, "the communicator's timeout changed"
        WORLD.Barrier()
        other.allreduce_(x)
        with collectively():
            assert np.array_equal(x, want)
    finally:
        comm.close()
        other.close()
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("kwargs, error, word", [
    ({"tag": 0}, ValueError, "tag"),
    ({"tag": -1}, ValueError, "tag"),
    ({"tag": 2**64}, ValueError, "tag"),
    ({"tag": 1.5}, TypeError, "tag"),
    ({"tag": True}, TypeError, "tag"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
])
def test_bad_options_name_the_argument(kwargs, error, word):
    with pytest.raises(error, match=word):
        gs.call_options(**kwargs)
    assert gs.call_options().tag is None  # nothing was set
