"""One injected divergence through the Horovod drop-in (issue 31): the last
rank allreduces a metric of its own while the others step a
DistributedOptimizer. Horovod matches operations by name, so nothing
mismatches: the ranks stall. Past the stall warning every rank writes its
flight record with what it has queued; past the stall shutdown every
queued operation raises on every rank, and the ranks carry on in step. The
doctor, from the records alone, names both ranks, their operations and the
lines of this file that submitted them."""
import inspect
import shutil

import pytest
from hvdtest import hvd, torch

import gradsync as gs
from gradsync import doctor
from gradsync.horovod import state
from gsutil import WORLD, collectively

pytestmark = pytest.mark.mpi


@pytest.fixture
def stalls_in_seconds():
    """Stall warning after 0.5 s, shutdown after 2 s (Horovod's knobs:
    HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS),
    flight stacks on, records in a folder of this test's."""
    engine = state.world_engine()
    before = (engine._stall_warn, engine._stall_shutdown, gs.flight_record_dir())
    folder = WORLD.bcast(__import__("tempfile").mkdtemp(prefix="gs-hvd-stall-")
                         if WORLD.rank == 0 else None)
    engine.configure(stall_warn=0.5, stall_shutdown=2.0)
    gs.flight_record_dir(folder)
    gs.flight_stacks(True)
    try:
        yield folder
    finally:
        gs.flight_stacks(False)
        engine.configure(stall_warn=before[0], stall_shutdown=before[1])
        gs.flight_record_dir(before[2])
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def test_divergence_named_by_the_doctor(stalls_in_seconds):
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    folder = stalls_in_seconds
    rank, late = hvd.rank(), hvd.size() - 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(8, 10)
    raised = None
    try:
        if rank == late:
            my_line = inspect.currentframe().f_lineno + 1
            hvd.allreduce(torch.ones(3), name="metric")
        else:
            loss = model(x).pow(2).mean()
            my_line = inspect.currentframe().f_lineno + 1
            loss.backward()   # the gradients' allreduces are submitted here
            opt.step()
    except Exception as e:  # noqa: BLE001 - judged collectively below
        raised = e
    lines = WORLD.allgather(my_line)
    # the ranks carry on in step: a collective after the stall agrees
    after = hvd.allreduce(torch.full((4,), float(rank)), op=hvd.Sum, name="after")
    WORLD.Barrier()
    rep = doctor.diagnose(folder) if rank == 0 else None
    code, verdict = WORLD.bcast((rep.code, rep.verdict) if rep else None)
    with collectively():
        assert isinstance(raised, hvd.HorovodInternalError), repr(raised)
        assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in str(raised), raised
        assert torch.equal(after, torch.full((4,), float(sum(range(hvd.size()))))), after
        assert code == doctor.MISMATCH, verdict
        assert verdict.startswith("Horovod operations differ by name on process set 0-%d: "
                                  % late), verdict
        assert ("rank %d queued allreduce.metric float32[3] sum at test_hvd_divergence.py:%d, "
                "which rank%s %s never submitted" % (
                    late, lines[late], "s" if late > 1 else "",
                    "0" if late == 1 else "0-%d" % (late - 1))) in verdict, verdict
        assert ("queued allreduce.noname." in verdict and
                "at test_hvd_divergence.py:%d, which rank %d never submitted" % (lines[0], late)
                in verdict), verdict


def test_no_stall_no_pending_records(stalls_in_seconds):
    """Names that match never stall: no pending record, and no Horovod
    verdict. (Not "nothing wrong": in this process the ring still holds the
    deliberate divergences of earlier test modules.)"""
    folder = stalls_in_seconds
    out = hvd.allreduce(torch.ones(5), op=hvd.Sum, name="fine")
    path = gs.dump_flight_record("on demand")
    with open(path) as f:
        pending = [line for line in f if '"type": "pending"' in line]
    WORLD.Barrier()
    rep = doctor.diagnose(folder) if WORLD.rank == 0 else None
    verdict = WORLD.bcast(rep.verdict if rep else None)
    with collectively():
        assert torch.equal(out, torch.full((5,), float(hvd.size()))), out
        assert not pending, pending
        assert not verdict.startswith("Horovod"), verdict
