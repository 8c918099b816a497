"""gsbench (gradsync.bench) run in-process: every collective and op with a
checked iteration reports #wrong = 0 in every row of every table (gradsync
and baselines), the JSON parses and carries one row per size per mode per
table, --baseline mpi4py yields both tables and the ratios, and --plot works
with matplotlib and says so clearly without it. Timings are never asserted."""
import json
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gradsync import bench
from gradsync.bench.data import cut_at_shards, shard_counts
from gsutil import collectively

pytestmark = pytest.mark.mpi

SIZES = ["-b", "64", "-e", "4K", "-f", "8"]          # 64, 512, 4096 bytes
NSIZES = 3
FAST = ["-n", "1", "-w", "0", "--repeats", "1", "-c", "1", "--no-progress"]
ROW_COLUMNS = {"size", "count", "type", "op", "tensors", "collective", "mode",
               "time_us", "algbw", "busbw", "wrong", "samples_us"}

# (flags, number of modes, baseline tables expected with --baseline mpi4py)
CASES = {
    "allreduce-sum": (["-o", "sum"], 2, ("mpi4py", "fused1")),
    "allreduce-average": (["-o", "average"], 2, ("mpi4py", "fused1")),
    "allreduce-min": (["-o", "min"], 2, ("mpi4py", "fused1")),
    "allreduce-max": (["-o", "max"], 2, ("mpi4py", "fused1")),
    "allreduce-prod": (["-o", "prod"], 2, ("mpi4py", "fused1")),
    "allreduce-adasum": (["-o", "adasum"], 2, ("numpy", "gssum")),
    "allreduce-adasum-f16": (["-o", "adasum", "-d", "float16"], 2, ("numpy", "gssum")),
    "allreduce-int32-sum": (["-o", "sum", "-d", "int32"], 2, ("mpi4py", "fused1")),
    "allreduce-bf16-average": (["-o", "average", "-d", "bfloat16"], 2, ()),  # no MPI bf16
    "broadcast": (["--collective", "broadcast", "-r", "LAST"], 2, ("mpi4py", "fused1")),
    "allgather": (["--collective", "allgather"], 1, ("mpi4py", "fused1")),
    "reduce_scatter": (["--collective", "reduce_scatter"], 1, ("mpi4py", "fused1")),
    "allgather_shards": (["--collective", "allgather_shards"], 1, ("mpi4py", "packed")),
    "reduce_scatter_shards": (["--collective", "reduce_scatter_shards"], 1,
                              ("mpi4py", "packed")),
    "reduce_scatter_shards-average": (["--collective", "reduce_scatter_shards",
                                       "-o", "average"], 1, ("mpi4py", "packed")),
    "accumulate-f16": (["--collective", "accumulate", "-d", "float16"], 1, ("numpy",)),
}


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """One directory for all ranks (rank 0's)."""
    path = str(tmp_path_factory.mktemp("gsbench")) if MPI.COMM_WORLD.rank == 0 else None
    return MPI.COMM_WORLD.bcast(path, root=0)


def flags(case):
    size = MPI.COMM_WORLD.size
    return [str(size - 1) if f == "LAST" else f for f in CASES[case][0]]


def check_tables(res, nmodes, baselines, tensors=3):
    tabs = res["tables"]
    assert set(tabs) == {"gradsync", *baselines}, sorted(tabs)
    for name, rows in tabs.items():
        assert len(rows) == NSIZES * nmodes, (name, len(rows))
        assert len({(r["size"], r["mode"]) for r in rows}) == len(rows), name
        for r in rows:
            assert ROW_COLUMNS <= set(r), (name, sorted(ROW_COLUMNS - set(r)))
            assert r["wrong"] == 0, (name, r)
            assert r["time_us"] > 0 and r["algbw"] > 0 and r["busbw"] >= 0, (name, r)
            assert len(r["samples_us"]) == 1
            assert 1 <= r["tensors"]
        if name == "gradsync":
            for r in rows:
                for b in baselines:
                    assert r["ratio_" + b] is not None and r["ratio_" + b] > 0, (b, r)
    assert res["summary"]["wrong"] == 0 and not res["summary"]["failed"]
    for b in baselines:
        assert res["summary"]["baseline_wrong"][b] == 0
    if baselines:
        assert set(res["summary"]["ratio_medians"][rows[0]["mode"]]) == set(baselines)


@pytest.mark.parametrize("case", sorted(CASES))
def test_collective(case, shared_dir, capsys):
    """Every row correct, every table complete, in the result and the JSON."""
    extra, nmodes, baselines = CASES[case]
    path = os.path.join(shared_dir, case + ".json")
    argv = flags(case) + SIZES + FAST + ["--tensors", "3", "--baseline", "mpi4py",
                                         "--json", path]
    res = bench.run(argv)
    out = capsys.readouterr().out
    with collectively():
        check_tables(res, nmodes, baselines)
        if MPI.COMM_WORLD.rank == 0:
            with open(path) as f:
                js = json.load(f)
            assert set(js) == {"metadata", "rows", "tables", "summary"}
            assert js["metadata"]["ranks"] == MPI.COMM_WORLD.size
            assert js["metadata"]["argv"][1:] == argv
            check_tables(js, nmodes, baselines)
            assert len(js["rows"]) == NSIZES
            # both tables printed, the ratio columns in the first
            assert "# Out of bounds values : 0 OK" in out
            assert out.count("# baseline table, ") == len(baselines), out
            headers = [line for line in out.splitlines() if line.split()[:2] == ["#", "size"]]
            assert len(headers) == 1 + len(baselines), out
            assert all("#wrong" in h for h in headers)
            if baselines:
                assert "ratio" in out and "time ratio median" in out
        else:
            assert out == ""


def test_without_baseline_one_table(shared_dir):
    res = bench.run(["--collective", "reduce_scatter_shards"] + SIZES + FAST)
    with collectively():
        check_tables(res, 1, ())
        assert "ratio_mpi4py" not in res["tables"]["gradsync"][0]


def test_single_tensor_and_uncut_sizes():
    """One tensor (fused1 repeats mpi4py) and sizes not divisible by anything."""
    res = bench.run(["-b", "12", "-e", "1000", "-f", "9"] + FAST + ["--baseline", "mpi4py"])
    with collectively():
        tabs = res["tables"]
        assert set(tabs) == {"gradsync", "mpi4py", "fused1"}
        assert all(r["wrong"] == 0 for t in tabs.values() for r in t)
        assert all(r.get("same_as") == "mpi4py" for r in tabs["fused1"] if r["tensors"] == 1)


def test_shard_lists_are_valid_layouts():
    """gsbench's shard lists (sizes split into K tensors, model lists cut at the
    ranks' ranges) are lists gs.ShardLayout accepts, with the same total."""
    rng = np.random.default_rng(8)
    with collectively():
        for size in range(1, 9):
            for total in [1, 2, 31, 32, 33, 64, 1000, 4096, 12345]:
                for k in (1, 2, 3, 7, 50):
                    counts = shard_counts(total, k, size)
                    assert sum(counts) == total and all(c > 0 for c in counts)
                    assert len(counts) >= min(k, total)
                    gs.ShardLayout(counts, size)
            for _ in range(20):
                numels = [int(n) for n in rng.integers(0, 5000, int(rng.integers(1, 30)))]
                cut = cut_at_shards(numels, size)
                assert sum(cut) == sum(numels)
                gs.ShardLayout(cut, size)


def test_latency_line():
    res = bench.run(["--latency", "-n", "20", "-w", "2", "--repeats", "1", "--no-progress"])
    with collectively():
        (row,) = res["rows"]
        assert row["wrong"] == 0 and row["gradsync_us"] > 0 and row["mpi4py_us"] > 0


def test_main_exit_code_and_progress_on_stderr(capsys):
    code = bench.main(["--collective", "accumulate"] + SIZES +
                      ["-n", "1", "-w", "0", "--repeats", "1", "-c", "1"])
    cap = capsys.readouterr()
    with collectively():
        assert code == 0
        assert "[gsbench]" not in cap.out
        if MPI.COMM_WORLD.rank == 0:
            assert "[gsbench]" in cap.err     # the progress line
            assert "# Out of bounds values : 0 OK" in cap.out


@pytest.mark.parametrize("argv", [
    ["--collective", "accumulate", "-d", "int32"],
    ["--collective", "allgather_shards", "--outplace-only"],
    ["--collective", "allgather", "--inplace-only"],
    ["--collective", "reduce_scatter_shards", "-o", "adasum"],
], ids=["accumulate-int", "shards-outplace", "allgather-inplace", "shards-adasum"])
def test_usage_errors(argv):
    with collectively():
        with pytest.raises(bench.UsageError):
            bench.run(argv + FAST)


def test_plot(shared_dir, monkeypatch, capsys):
    """With matplotlib: a PNG with gradsync and the baseline. Without it: a
    clear message, no file, and the run itself still succeeds."""
    have_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        have_mpl = False
    argv = ["-o", "sum"] + SIZES + FAST + ["--baseline", "mpi4py"]
    path = os.path.join(shared_dir, "plot.png")
    if have_mpl:
        bench.run(argv + ["--plot", path])
        MPI.COMM_WORLD.Barrier()
        with collectively():
            if MPI.COMM_WORLD.rank == 0:
                with open(path, "rb") as f:
                    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    missing = os.path.join(shared_dir, "missing.png")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import raises ImportError
    res = bench.run(argv + ["--plot", missing])
    cap = capsys.readouterr()
    with collectively():
        assert not res["summary"]["failed"]
        if MPI.COMM_WORLD.rank == 0:
            assert not os.path.exists(missing)
            assert "--plot needs matplotlib" in cap.err
            assert "pip install matplotlib" in cap.err
