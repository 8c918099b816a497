"""Network faults on a simulated cluster (scripts/simcluster): a host's data
link goes down, or a host's ranks are killed, in the middle of a stream of
collectives (tests/cluster/fault_job.py). Nothing may hang: every rank raises
a gradsync error naming the operation within the timeout plus a few seconds,
or the launcher ends the job with a message; no call returns a wrong value
as success; the simulated cluster is gone afterwards. After a link went
down, `python -m gradsync.doctor` over the ranks' flight records must call it
a transport or network fault in the call every rank entered.

A plain pytest (one process, root, no MPI of its own):
    python -m pytest tests/cluster/test_cluster_faults.py
"""
import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest
from simcluster_skip import HERE, ROOT, SIMCLUSTER, needs_simcluster

JOB = os.path.join(HERE, "fault_job.py")
TIMEOUT = 5.0     # GRADSYNC_TIMEOUT_SECONDS in the link-down runs
SLACK = 20.0      # seconds past it a rank may take to report (a call in flight,
                  # a loaded machine): the bound tells a timeout from a hang
FAULT_AFTER = 3.0

pytestmark = needs_simcluster


def run_faulty_job(tmp_path, mode, hosts, ranks, **env):
    out = tmp_path / "out"
    out.mkdir()
    full_env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "pyx"), **env)
    full_env.pop("GRADSYNC_TIMEOUT_SECONDS", None)
    full_env.update(env)
    cmd = [sys.executable, SIMCLUSTER, "--hosts", str(hosts), "--ranks-per-host", str(ranks),
           "--timeout", "180", "--", sys.executable, JOB, "--mode", mode,
           "--after", str(FAULT_AFTER), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=300)
    ended = time.time()  # the job's clock too: one host
    fault_at = float(open(out / "fault_at").read()) if (out / "fault_at").exists() else None
    ranks_out = {}
    for f in glob.glob(str(out / "rank*.json")):
        rec = json.load(open(f))
        ranks_out[rec["rank"]] = rec
    events = [json.loads(line) for line in open(out / "events.jsonl")] \
        if (out / "events.jsonl").exists() else []
    log = r.stdout + r.stderr
    prefix = re.search(r"\((gsc\d+)\)", log)
    # how long the job went on after the fault (None: no fault)
    after_fault = ended - fault_at if fault_at is not None else None
    return r.returncode, after_fault, fault_at, ranks_out, events, log, prefix and prefix.group(1)


def assert_cleaned_up(prefix, log):
    assert prefix, "simcluster did not name its run:\n" + log
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left, "namespaces left behind: %s" % left
    assert not os.path.exists("/run/simcluster/" + prefix)


def assert_no_bad_success(ranks_out, events):
    for rec in list(ranks_out.values()) + events:
        assert not rec.get("bad"), "a call returned a wrong value as success: %s" % rec


@pytest.mark.parametrize("hosts,ranks,hier_mode", [(2, 2, None), (2, 2, "0"), (3, 1, None)],
                         ids=["2x2-default", "2x2-flat", "3x1"])
def test_link_down_raises_on_every_rank(tmp_path, hosts, ranks, hier_mode):
    flight = tmp_path / "flight"
    env = {"GRADSYNC_TIMEOUT_SECONDS": str(TIMEOUT), "GRADSYNC_FLIGHT_DIR": str(flight)}
    if hier_mode is not None:
        env["GRADSYNC_HIERARCHICAL"] = hier_mode
    rc, after_fault, fault_at, recs, events, log, prefix = run_faulty_job(
        tmp_path, "linkdown", hosts, ranks, **env)
    n = hosts * ranks
    assert fault_at is not None, "the link was never taken down:\n" + log
    assert sorted(recs) == list(range(n)), "ranks that did not report: %s\n%s" % (
        sorted(set(range(n)) - set(recs)), log)
    for r, rec in sorted(recs.items()):
        assert rec["error"] == "TimeoutError" or (rec["error"] and "MPI" in rec["message"]), rec
        assert re.search(r"allreduce|broadcast|allgather|barrier", rec["message"]), rec
        assert rec["raised_at"] - fault_at <= TIMEOUT + SLACK, (r, rec["raised_at"] - fault_at)
    assert_no_bad_success(recs, events)
    hier = max((e.get("hierarchical", 0) for e in events), default=0)
    assert (hier > 0) == (ranks > 1 and hier_mode != "0"), "hierarchical messages: %d" % hier
    assert rc != 0 and rc != 124, "the job should end with the ranks' failure: rc %d" % rc
    assert after_fault < TIMEOUT + SLACK + 30, after_fault
    assert_cleaned_up(prefix, log)
    assert_doctor_says_network(flight, n, recs)


def assert_doctor_says_network(flight, n, recs):
    """Every rank dumped on its timeout, and the doctor (run as a user would,
    on the files alone) names the call every rank entered and never finished
    as a transport or network fault (its exit status 4)."""
    r = subprocess.run([sys.executable, "-m", "gradsync.doctor", str(flight)],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "pyx")))
    verdict = r.stdout.split("\n")[0]
    assert r.returncode == 4, r.stdout + r.stderr
    assert "ranks 0-%d of %d" % (n - 1, n) in r.stdout, r.stdout
    # all ranks wait in one call, or (a broadcast's root side done, say) the
    # ranks of one host wait in the call the others completed
    m = re.match(r"(.+?) #(\d+) on WORLD (was entered by every rank but never completed|"
                 r"completed on ranks [-0-9,]+ but never on ranks [-0-9,]+, which still wait)"
                 r".*a transport or network fault", verdict)
    assert m, r.stdout
    # the call the doctor names is one the ranks were in
    assert any(m.group(1).split()[0] in rec["message"] for rec in recs.values()), (verdict, recs)


def test_killed_host_ends_the_job_with_a_message(tmp_path):
    """No timeout set: the launcher notices the dead ranks and ends the job."""
    rc, after_fault, fault_at, recs, events, log, prefix = run_faulty_job(tmp_path, "kill", 2, 2)
    assert fault_at is not None, log
    assert rc not in (0, 124), "rc %d\n%s" % (rc, log)
    assert re.search(r"BAD TERMINATION|KILLED|terminated", log), log
    assert not any(rec.get("error") is None for rec in recs.values()), recs
    assert_no_bad_success(recs, events)
    assert after_fault < 60, after_fault
    assert_cleaned_up(prefix, log)
