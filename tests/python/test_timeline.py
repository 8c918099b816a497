"""The Chrome-trace timeline (gs.start_timeline / GRADSYNC_TIMELINE) and
GRADSYNC_LOG_LEVEL: a known sequence of calls leaves its phases in the file;
log lines carry the rank and respect the level."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collectively

pytestmark = pytest.mark.mpi


def shared_tmp(tmp_path_factory):
    """One directory for all ranks (rank 0's), as a string."""
    path = str(tmp_path_factory.mktemp("tl")) if MPI.COMM_WORLD.rank == 0 else None
    return MPI.COMM_WORLD.bcast(path, root=0)


def test_known_sequence(tmp_path_factory):
    path = os.path.join(shared_tmp(tmp_path_factory), "trace.json")
    comm = gs.Communicator(fusion_threshold=4096)
    xs = [np.ones(n, np.float32) for n in (10, 700, 3000, 5000)]
    gs.start_timeline(path)
    comm.allreduce_(xs)                      # several messages, packed and not
    comm.allreduce_(xs, op="adasum")
    comm.broadcast_(xs, root=0)
    comm.allgather([np.ones((3, 2))])
    comm.reduce_scatter([np.ones((8, 2))])
    comm.allreduce_(np.ones(4))              # rides in the validation message
    gs.stop_timeline()
    comm.allreduce_(np.ones(4))              # not recorded
    comm.close()
    MPI.COMM_WORLD.Barrier()
    with collectively():
        if MPI.COMM_WORLD.rank != 0:
            return
        with open(path) as f:
            events = json.load(f)
        spans = [e for e in events if e["ph"] == "X"]
        meta = [e for e in events if e["ph"] == "M"]
        names = {(e["name"], e["cat"]) for e in spans}
        assert ("validate", "allreduce") in names
        assert ("communicate", "allreduce") in names
        assert ("pack", "allreduce") in names and ("unpack", "allreduce") in names
        assert ("communicate", "broadcast") in names
        assert ("communicate", "allgather") in names
        assert ("communicate", "reduce_scatter") in names
        assert ("validate + reduce", "allreduce") in names
        if comm.size > 1:
            assert ("adasum level 0", "allreduce adasum") in names
            assert ("adasum allgather", "allreduce adasum") in names
        assert sum(1 for e in spans if e["name"] == "validate + reduce") == 1
        for e in spans:
            assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0
            assert isinstance(e["tid"], int) and e["args"]["bytes"] >= 0
        rows = {e["tid"] for e in spans}
        assert {e["tid"] for e in meta if e["name"] == "thread_name"} >= rows
        assert max(rows) >= 3, "one row per fused message: 10+700, 3000 and 5000 floats"
        starts = [e["ts"] for e in spans if e["tid"] == 0]
        assert starts == sorted(starts)


def _singleton(code, env_extra, tmp):
    """Runs `code` in a fresh single-process MPI job (no launcher variables)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_LOCALNRANKS",
                                "MPI_LOCALRANKID"))}
    env.update(env_extra)
    script = os.path.join(tmp, "run.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(code))
    return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=120)


CODE = """
    import numpy as np
    import gradsync as gs
    c = gs.Communicator()
    c.allreduce_([np.ones(100000)])
    c.close()
"""


def test_env_timeline_and_log_levels(tmp_path):
    if MPI.COMM_WORLD.rank != 0:
        return  # one subprocess is enough, and avoids rank-dependent work in parallel
    trace = str(tmp_path / "env.json")
    r = _singleton(CODE, {"GRADSYNC_TIMELINE": trace, "GRADSYNC_LOG_LEVEL": "debug"},
                   str(tmp_path))
    assert r.returncode == 0, r.stderr
    with open(trace) as f:
        events = json.load(f)
    assert any(e["ph"] == "X" and e["name"] == "communicate" for e in events)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[gradsync rank 0]")]
    assert any(" INFO: communicator: rank 0 of 1" in ln for ln in lines), r.stderr
    assert any(" DEBUG: allreduce: 1 tensors, 800000 bytes" in ln for ln in lines), r.stderr
    quiet = _singleton(CODE, {"GRADSYNC_LOG_LEVEL": "error"}, str(tmp_path))
    assert quiet.returncode == 0, quiet.stderr
    assert "[gradsync" not in quiet.stderr, quiet.stderr
