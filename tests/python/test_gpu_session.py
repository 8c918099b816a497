"""The GPU session's tools, without a GPU (scripts/gpu_session.sh runs them on
the device machine, where a mistake costs lease minutes):

- gpu_summary.py reads a session directory written out here by hand (step
  records, logs with the C tests', pytest's and compute-sanitizer's own
  lines, a bench result) and reports each step's status and counts, and
  every figure with its goal;
- the session scripts parse (bash -n).
"""
import io
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

import gpu_summary  # noqa: E402

from bench import gpu_figures  # noqa: E402

C_LOG = "== something\ntest_device_paths (2 ranks): 24068 passed, 0 failed\n"
C_SKIPPED = ("test_device_paths: no CUDA device, skipped\n"
             "test_device_paths (1 ranks): 1 passed, 0 failed\n")
PYTEST_2 = ("....s..\n370 passed, 12 skipped, 3 warnings in 81.20s (0:01:21)\n"
            "....s..\n370 passed, 12 skipped, 3 warnings in 81.31s (0:01:21)\n")
PYTEST_SPLIT = "1 failed, 369 passed, 12 skipped in 80.00s\n370 passed, 12 skipped in 80.10s\n"
PYTEST_SKIPPED = "370 skipped in 3.3s\n"
MEMCHECK = "========= COMPUTE-SANITIZER\ntest_device_paths (1 ranks): 9 passed, 0 failed\n" \
           "========= ERROR SUMMARY: 0 errors\n"
RACECHECK = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"

BENCH = {
    "environment": {"gpu": "NVIDIA H100 80GB HBM3", "ranks": 1, "torch": "2.11.0",
                    "gradsync": {"nccl": "2.27.7"}},
    "dry_run": False,
    "accumulate": {"fraction_of_copy": 0.91, "speedup_vs_torch_add_cast": 2.5,
                   "speedup_vs_torch_add_mixed": 1.02, "check": "ok"},
    "bert": {"f32+=f32": {"speedup_vs_loop": 7.5, "speedup_vs_foreach": 1.1, "check": "ok"},
             "f32+=bf16": {"speedup_vs_loop": 8.25, "speedup_vs_foreach": 1.3,
                           "check": "tensor 3: 1 elements differ"}},
    "allreduce": {"error": "RuntimeError: NCCL error"},
}


def write_state(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = [("build", "pass", 40, 0), ("c_np1", "pass", 20, 0), ("c_np2", "pass", 33, 0),
             ("pytest_np1", "pass", 3, 0), ("pytest_np2", "fail", 81, 1),
             ("memcheck", "pass", 120, 0), ("racecheck", "timeout", 240, 124),
             ("c_np1", "pass", 21, 0)]  # a retry: the last record counts
    (tmp_path / "steps.tsv").write_text(
        "".join(f"{n}\t{s}\t{t}\t{rc}\n" for n, s, t, rc in steps))
    (logs / "c_np1.log").write_text(C_SKIPPED)
    (logs / "c_np2.log").write_text(C_LOG)
    (logs / "pytest_np1.log").write_text(PYTEST_SKIPPED)
    (logs / "pytest_np2.log").write_text(PYTEST_SPLIT)
    (logs / "memcheck.log").write_text(MEMCHECK)
    (logs / "racecheck.log").write_text(RACECHECK)
    (tmp_path / "info.txt").write_text(
        "name, driver_version, memory.total\nNVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n"
        "torch nccl (2, 27, 7) gpu NVIDIA H100 80GB HBM3\n")
    (tmp_path / "bench_np1.json").write_text(json.dumps(BENCH))


def row(text, name):
    return next(line for line in text.splitlines() if line.startswith(name + " "))


def test_summary_reads_steps_logs_and_figures(tmp_path):
    write_state(tmp_path)
    out = io.StringIO()
    gpu_summary.summary(str(tmp_path), out)
    text = out.getvalue()
    assert "device: NVIDIA H100 80GB HBM3   driver: 580.159.04   torch's NCCL: (2, 27, 7)" in text
    assert row(text, "c_np1").split()[1:3] == ["EMPTY", "21"]    # skipped, and the retry's time
    assert row(text, "c_np2").split()[1] == "pass"
    assert "test_device_paths@2: 24068 passed, 0 failed" in row(text, "c_np2")
    assert row(text, "pytest_np1").split()[1] == "EMPTY"
    assert row(text, "pytest_np2").split()[1] == "fail"
    assert "1 failed, 369 passed, 12 skipped | 370 passed, 12 skipped" in row(text, "pytest_np2")
    assert "ERROR SUMMARY: 0 errors" in row(text, "memcheck")
    assert row(text, "racecheck").split()[1] == "timeout"
    assert "RACECHECK SUMMARY: 0 hazards" in row(text, "racecheck")
    assert "steps not passed: pytest_np2 racecheck c_np1 pytest_np1" in text
    fraction = next(line for line in text.splitlines() if "fraction of D2D copy" in line)
    assert fraction.split()[-4:] == ["0.910", ">=", "0.85", "ok"]
    bf16 = next(line for line in text.splitlines() if "f32+=bf16: speed-up vs Python" in line)
    assert "8.250" in bf16 and bf16.endswith("tensor 3: 1 elements differ")
    assert "allreduce: RuntimeError: NCCL error" in text


def test_pytest_counts_of_identical_ranks_are_said_once():
    assert gpu_summary.counts(PYTEST_2) == "370 passed, 12 skipped, 3 warnings (each of 2 ranks)"


def test_training_figures_and_trace_table():
    train = {"ranks": 2, "device_transport": "mpi-staged", "width": 64, "parameters": 25557032,
             "batch_per_rank": 32, "image": 224, "timed_rounds": 10,
             "gradsync_vs_ddp_gloo": 0.8,
             "modes": {"compute": {"what": "c", "median_s": 0.1},
                       "comm": {"what": "m", "median_s": 0.05},
                       "gradsync": {"what": "g", "median_s": 0.12, "vs_compute": 1.2,
                                    "share_of_comm_hidden": 0.6},
                       "ddp-gloo": {"what": "d", "median_s": 0.15, "vs_compute": 1.5,
                                    "share_of_comm_hidden": None}},
             "replicas_identical": {"gradsync": True, "ddp-gloo": True},
             "gradsync_vs_ddp_params_max_rel_diff": 1e-7,
             "trace": {"gradsync": {"backward_span_ms": 30.0, "comm_busy_ms": 4.0,
                                    "comm_overlap_share": 0.75}}}
    rows = {what: (v, goal) for what, v, goal, _ in gpu_figures.figure_rows({"train": train})}
    assert rows["(d) ResNet-50 step: gradsync / DDP-gloo"] == (0.8, "< 1")
    hidden = rows["(d) share of comm hidden (compute+comm-step)/comm, DDP-gloo"][0]
    assert math.isnan(hidden)  # unknown
    out = io.StringIO()
    gpu_figures.print_train(train, out)
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("gradsync ")
                and "ms" not in x)
    cells = line.split()
    assert cells[0] == "gradsync" and cells[1] == "30.00" and cells[3] == "4.00"
    assert cells[5] == "0.75" and cells[2] == "n/a"


def test_session_scripts_parse():
    for name in ("gpu_session.sh", "gpu_prepare.sh"):
        p = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, name)],
                           capture_output=True, text=True, check=False)
        assert p.returncode == 0, (name, p.stderr)
