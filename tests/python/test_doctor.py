"""gradsync.doctor on dumps written here by hand from the format's
description (docs/GUIDE.md "When a job hangs"), independent of the C
recorder: each class of problem, its verdict and its exit status."""
import json
import os

import pytest

from gradsync import doctor

SITES = {0: "/job/train.py:88 in step\n/job/train.py:120 in main",
         1: "/job/train.py:95 in step\n/job/train.py:120 in main",
         2: "/usr/lib/python3.11/site-packages/lib.py:5 in helper\n/job/eval.py:14 in evaluate"}


def call(seq, op, status="ok", site=-1, dtype="float32", count=100, redop="sum", root=0,
         p2p=False, tag=0, t=10.0, valid=True, sent=True, done=True, comm=0, ident=None):
    return {"v": 1, "type": "call", "id": ident if ident is not None else seq, "comm": comm,
            "seq": seq, "op": op, "p2p": p2p, "dtype": dtype, "count": count, "n": 1,
            "bytes": 4 * count, "redop": redop, "root": root, "path": "mpi", "status": status,
            "t_enter": t, "t_valid": t + 0.1 if valid else 0, "t_sent": t + 0.2 if sent else 0,
            "t_done": t + 0.3 if done else 0, "thread": 1, "site": site, "tag": tag}


def write(folder, rank, world, calls, reason="timeout", last_seq=None, sites=(0, 1, 2)):
    lines = [{"v": 1, "type": "header", "format": "gradsync-flight", "rank": rank,
              "world_size": world, "pid": 100 + rank, "host": "h", "reason": reason,
              "clock": 50.0, "wall": 1e9, "capacity": 4096, "recorded": len(calls), "stacks": 1},
             {"v": 1, "type": "comm", "comm": 0, "uid": "00000000000000aa.0", "size": world,
              "rank": rank, "freed": False, "ranks": list(range(world)),
              "last_seq": last_seq if last_seq is not None else
              max([c["seq"] for c in calls if not c["p2p"]], default=0)}]
    lines += [{"v": 1, "type": "site", "site": k, "stack": SITES[k]} for k in sites]
    with open(os.path.join(folder, "rank-%d.jsonl" % rank), "w") as f:
        for rec in lines + calls:
            f.write(json.dumps(rec) + "\n")


def run(folder, capsys):
    code = doctor.main([str(folder)])
    out = capsys.readouterr().out
    return code, out.split("\n")[0], out


def history(n, site=0):
    return [call(s, "allreduce", site=site) for s in range(1, n + 1)]


def test_rank_never_called(tmp_path, capsys):
    bcast = call(56, "broadcast", site=1, dtype="int64", count=3)
    for r in (0, 1):
        write(tmp_path, r, 3, history(55) + [bcast, call(57, "allreduce", "timeout", site=0,
                                                         done=False, sent=False, valid=False)])
    write(tmp_path, 2, 3, history(55) + [bcast], reason="SIGUSR1")
    code, verdict, out = run(tmp_path, capsys)
    assert code == doctor.NEVER_CALLED == 2
    assert verdict.startswith("rank 2 never called allreduce #57 on WORLD (ranks 0-1 wait in it "
                              "at train.py:88); rank 2: its last call was broadcast int64[3] "
                              "root 0 #56 at train.py:95"), verdict
    assert "so it is in its own code" in verdict
    assert "/job/train.py:95 in step" in out  # the straggler's stack in the evidence


def test_straggler_waiting_elsewhere_names_library_callers_user_line(tmp_path, capsys):
    write(tmp_path, 0, 2, history(3) + [call(4, "allreduce", "in_flight", site=0, done=False)])
    write(tmp_path, 1, 2, history(3) + [call(1, "recv", "in_flight", p2p=True, root=0, tag=7,
                                             site=2, done=False, ident=10)])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.NEVER_CALLED
    assert ("rank 1: it was waiting in recv float32[100] from rank 0 tag 7 at eval.py:14"
            in verdict), verdict  # the first frame outside site-packages


def test_ranks_disagree(tmp_path, capsys):
    write(tmp_path, 0, 2, history(11) + [call(12, "allreduce", "mismatch", site=0)])
    write(tmp_path, 1, 2, history(11) + [call(12, "allgather", "mismatch", site=1, redop="sum")])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.MISMATCH == 3
    assert verdict == ("ranks disagree at call #12 on WORLD: rank 0 allreduce float32[100] sum at "
                       "train.py:88 vs rank 1 allgather float32[100] at train.py:95"), verdict


def test_the_newest_detected_mismatch_is_reported(tmp_path, capsys):
    """A mismatch the job survived (gradsync fails the call on every rank
    and the ranks go on in step), then another one: the dump is about the
    newer one."""
    old = lambda r: call(3, "allreduce", "mismatch", count=4 - r)  # noqa: E731
    new = lambda r, op: call(9, op, "mismatch", site=r)  # noqa: E731
    write(tmp_path, 0, 2, history(2) + [old(0)] + history(8)[3:] + [new(0, "allreduce")])
    write(tmp_path, 1, 2, history(2) + [old(1)] + history(8)[3:] + [new(1, "broadcast")])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.MISMATCH
    assert verdict.startswith("ranks disagree at call #9 on WORLD: rank 0 allreduce"), verdict
    assert "rank 1 broadcast" in verdict, verdict


def test_a_survived_mismatch_is_not_the_verdict(tmp_path, capsys):
    """The ranks went on in step after a mismatch (the Horovod drop-in
    negotiates after each one): a dump on demand later finds nothing wrong."""
    old = lambda r: call(3, "allreduce", "mismatch", count=4 - r)  # noqa: E731
    for r in range(2):
        write(tmp_path, r, 2, history(2) + [old(r)] + history(8)[3:], reason="on demand")
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.OK, verdict


def test_shapes_differ(tmp_path, capsys):
    write(tmp_path, 0, 2, history(4) + [call(5, "allreduce", site=0, count=100)])
    write(tmp_path, 1, 2, history(4) + [call(5, "allreduce", site=0, count=50)])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.MISMATCH
    assert "rank 0 allreduce float32[100] sum" in verdict
    assert "rank 1 allreduce float32[50]" in verdict


def test_entered_everywhere_never_completed(tmp_path, capsys):
    for r in range(3):
        write(tmp_path, r, 3, history(8) + [call(9, "allreduce", "timeout", done=False)])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.STUCK == 4
    assert verdict.startswith("allreduce #9 on WORLD was entered by every rank but never "
                              "completed (stuck moving data after validation on ranks 0-2)"), \
        verdict


def test_data_that_never_arrived(tmp_path, capsys):
    """A broadcast's root side completed and went on; the receivers still
    wait in it: they did call it, so the data was lost on the way."""
    done = history(8) + [call(9, "broadcast", root=2)]
    for r in (2, 3):
        write(tmp_path, r, 4, done + [call(10, "allgather", "timeout", sent=False, done=False)])
    for r in (0, 1):
        write(tmp_path, r, 4, history(8) + [call(9, "broadcast", "timeout", root=2, done=False)])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.STUCK
    assert verdict.startswith("broadcast #9 on WORLD completed on ranks 2-3 but never on ranks "
                              "0-1, which still wait in it (the others went on to #10)"), verdict
    assert verdict.endswith("a transport or network fault, not the program"), verdict


def test_straggler_in_another_call_is_not_lost_data(tmp_path, capsys):
    """The straggler waits in a call with another root than the others
    completed: a program that diverged, not data lost on the way."""
    for r in (1, 2):
        write(tmp_path, r, 3, history(8) + [call(9, "broadcast", root=1),
                                            call(10, "allreduce", "timeout", done=False)])
    write(tmp_path, 0, 3, history(8) + [call(9, "broadcast", "timeout", root=0, done=False)])
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.MISMATCH, verdict
    assert verdict.startswith("ranks disagree at call #9 on WORLD: rank 0 broadcast "
                              "float32[100] root 0 vs ranks 1-2"), verdict


def pending(name, site, shape=(3,), redop="sum", age=5.0):
    return {"v": 1, "type": "pending", "set": [0, 1, 2], "name": name, "op": "allreduce",
            "tensors": [["float32", list(shape)]], "redop": redop, "root": None, "age": age,
            "site": site}


def test_horovod_names_differ(tmp_path, capsys):
    """The Horovod drop-in's stall report: ranks 0-1 queued the gradients'
    name, rank 2 a metric of its own; every collective succeeded."""
    for r in (0, 1):
        write(tmp_path, r, 3, history(6) + [pending("allreduce.noname.0", 0, (67,), "average")],
              reason="horovod stall", last_seq=6)
    write(tmp_path, 2, 3, history(6) + [pending("allreduce.metric", 1, age=6.0)],
          reason="horovod stall", last_seq=6)
    code, verdict, out = run(tmp_path, capsys)
    assert code == doctor.MISMATCH
    assert verdict == (
        "Horovod operations differ by name on process set 0-2: rank 2 queued allreduce.metric "
        "float32[3] sum at train.py:95, which ranks 0-1 never submitted; ranks 0-1 queued "
        "allreduce.noname.0 float32[67] average at train.py:88, which rank 2 never submitted; "
        "the ranks wait for each other (a stall)"), verdict
    assert "rank 2: allreduce.metric float32[3] sum, queued 6.0 s before its dump" in out


def test_horovod_rank_that_queued_nothing(tmp_path, capsys):
    for r in (0, 1):
        write(tmp_path, r, 3, history(6) + [pending("allreduce.loss", 0)], last_seq=6)
    write(tmp_path, 2, 3, history(6), last_seq=6)
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.NEVER_CALLED
    assert verdict.endswith("which rank 2 never submitted; the ranks wait for each other "
                            "(a stall); rank 2 queued nothing (in its own code)"), verdict


def test_rank_without_dump(tmp_path, capsys):
    for r in (0, 1, 3):
        write(tmp_path, r, 4, history(20) + [call(21, "allreduce", "timeout", done=False)])
    code, verdict, out = run(tmp_path, capsys)
    assert code == doctor.MISSING == 5
    assert verdict == ("rank 2 left no dump (dead, or its host is down) and ranks 0-1,3 wait in "
                       "allreduce #21 on WORLD"), verdict
    assert "no dump from ranks 2" in out


def test_healthy_and_empty(tmp_path, capsys):
    for r in range(2):
        write(tmp_path, r, 2, history(5), reason="on demand")
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.OK and verdict.startswith("no hang or disagreement found")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, verdict, _ = run(empty, capsys)
    assert code == doctor.NO_DUMPS and verdict.startswith("no flight records")


@pytest.mark.parametrize("junk", ["{not json\n", json.dumps({"v": 99, "type": "call"}) + "\n"])
def test_unreadable_lines_are_skipped(tmp_path, capsys, junk):
    write(tmp_path, 0, 2, history(2) + [call(3, "broadcast", "timeout", done=False)])
    write(tmp_path, 1, 2, history(2))
    with open(tmp_path / "rank-1.jsonl", "a") as f:
        f.write(junk)
    code, verdict, _ = run(tmp_path, capsys)
    assert code == doctor.NEVER_CALLED and verdict.startswith("rank 1 never called broadcast #3")
