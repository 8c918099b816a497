"""bench.gpu without a GPU, so that its mistakes show here and not
in a GPU lease:

- its dry run (torch on the CPU, tiny sizes) goes through every section at
  1 rank and the training section at 2 ranks (its own mpiexec job), checks
  its own results (bitwise against torch) and writes every field the
  figure table reads;
- its latency section (issue 30: gradsync's non-blocking NCCL against
  torch.distributed's, 4 B to 1 MiB) runs at 2 ranks, checks both
  libraries' sums and gives a figure per size;
- the ResNet-50 it trains is the published one: the same 161 parameter
  names and shapes as gradient_shapes.json;
- the trace reader measures overlap right on a trace written out by hand.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import bench.gpu_train as bt  # noqa: E402
from bench.gpu_figures import figure_rows  # noqa: E402
from gradsync.bench.data import load_shapes  # noqa: E402
from gsutil import child_env, collectively  # noqa: E402

WORLD = MPI.COMM_WORLD
one_rank = pytest.mark.skipif(WORLD.size != 1, reason="runs at 1 rank (it starts its own jobs)")


def test_resnet50_is_the_published_model():
    with collectively():
        with open(load_shapes("resnet50")[1]) as f:
            want = json.load(f)["resnet50"]["shapes"]
        with torch.device("meta"):
            model = bt.ResNet50()
        got = [(n, list(p.shape)) for n, p in model.named_parameters()]
        assert got == [(s["name"], s["shape"]) for s in want]


def test_resnet_forward_at_a_small_width():
    with collectively():
        torch.manual_seed(0)
        model = bt.ResNet50(width=4, classes=7)
        y = model(torch.randn(2, 3, 32, 32))
        assert tuple(y.shape) == (2, 7) and bool(torch.isfinite(y).all())


def event(cat, ts, dur, name="k", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_trace_summary_on_a_hand_made_trace(tmp_path):
    """Two steps. Step 1: backward (CPU 100-200) launches two kernels that run
    on stream 7 at 150-170 and 175-200; a forward kernel (launched at 50)
    runs at 60-90; the communication stream 20 copies at 180-230 and 240-250.
    Step 2 (CPU 1000-1300): one backward kernel at 1100-1200 on stream 7,
    communication only after it, at 1210-1260."""
    ev = [event("user_annotation", 0, 300, bt.STEP),
          event("user_annotation", 100, 100, bt.BACKWARD),
          event("cuda_runtime", 50, 1, "cudaLaunchKernel", correlation=1),
          event("cuda_runtime", 110, 1, "cudaLaunchKernel", correlation=2),
          event("cuda_runtime", 120, 1, "cudaLaunchKernel", correlation=3),
          event("kernel", 60, 30, stream=7, correlation=1),
          event("kernel", 150, 20, stream=7, correlation=2),
          event("kernel", 175, 25, stream=7, correlation=3),
          event("gpu_memcpy", 180, 50, stream=20, correlation=90),
          event("gpu_memcpy", 240, 10, stream=20, correlation=91),
          event("user_annotation", 1000, 300, bt.STEP),
          event("user_annotation", 1010, 150, bt.BACKWARD),
          event("cuda_runtime", 1020, 1, "cudaLaunchKernel", correlation=4),
          event("kernel", 1100, 100, stream=7, correlation=4),
          event("kernel", 1210, 50, stream=21, correlation=92)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    with collectively():
        s = bt.trace_summary(str(path))
        # step 1 in us: span 150-200 = 50, busy 45, comm 60, inside 20, over kernels 20,
        # lead 200-180 = 20, tail 250-200 = 50; step 2: span 100, busy 100, comm 50,
        # inside 0, lead -10, tail 60. Medians of two: the means.
        want = {"backward_span_ms": 0.075, "backward_busy_ms": 0.0725, "comm_busy_ms": 0.055,
                "comm_in_backward_ms": 0.010, "comm_overlap_share": (20 / 60) / 2,
                "comm_overlaps_kernels_ms": 0.010, "comm_lead_ms": 0.005,
                "comm_tail_ms": 0.055, "compute_stream": 7, "comm_streams": 1}
        assert s["steps"] == 2 and s["steps_with_gpu_work"] == 2
        for k, v in want.items():
            assert s[k] == pytest.approx(v), (k, s[k], v)


def run_dry(tmp_path, nranks, only=None):
    out = tmp_path / f"dry{nranks}.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--json", str(out),
           "--trace-dir", str(tmp_path / f"traces{nranks}")]
    if only or nranks == 1:
        cmd += ["--only", only or "accumulate,bert,allreduce,train"]
    if nranks > 1:
        mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
        cmd = [mpiexec, "-n", str(nranks)] + cmd
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return json.loads(out.read_text()), p.stdout


@one_rank
def test_dry_run_one_rank_every_section(tmp_path):
    r, stdout = run_dry(tmp_path, 1)
    assert r["dry_run"] is True and r["environment"]["ranks"] == 1
    assert r["accumulate"]["check"] == "ok" and r["accumulate"]["elements"] == 4099
    for label in ("f32+=f32", "f32+=bf16"):
        assert r["bert"][label]["check"] == "ok" and r["bert"][label]["gradsync_s"] > 0
    assert r["bert"]["tensors"] == 199
    assert r["allreduce"]["check"] == "ok" and r["allreduce"]["tensors"] == 161
    assert r["allreduce"]["torch_backend"] == "gloo"
    train = r["train"]
    assert set(train["modes"]) == {"compute", "comm", "gradsync", "ddp-gloo"}
    assert train["replicas_identical"] == {"gradsync": True, "ddp-gloo": True}
    assert set(train["trace"]) == {"compute", "gradsync", "ddp-gloo"}
    names = [what for what, _, _, _ in figure_rows(r)]
    assert len(names) == 3 + 4 + 3 + 5, names
    assert "DRY RUN" in stdout


@one_rank
@pytest.mark.extended  # make test's gpu-session-dry runs this section at 2 ranks
def test_dry_run_two_ranks_training(tmp_path):
    r, _ = run_dry(tmp_path, 2)
    train = r["train"]
    assert train["ranks"] == 2 and train["timed_rounds"] >= 3
    assert train["replicas_identical"] == {"gradsync": True, "ddp-gloo": True}
    # the same data, the same averaging: DistributedOptimizer and DDP agree
    assert train["gradsync_vs_ddp_params_max_rel_diff"] < 1e-5
    assert all(m["median_s"] > 0 for m in train["modes"].values())
    assert os.path.exists(tmp_path / "traces2" / "trace_gradsync.json")


@one_rank
@pytest.mark.extended  # make test's gpu-session-dry runs this section at 2 ranks
def test_dry_run_two_ranks_latency(tmp_path):
    r, stdout = run_dry(tmp_path, 2, only="latency")
    e = r["latency"]
    assert e["check"] == "ok" and e["ranks"] == 2 and e["torch_backend"] == "gloo"
    assert [x["bytes"] for x in e["sizes"]] == [4, 16, 64, 256, 1024, 4096]
    for x in e["sizes"]:
        assert x["samples"] >= 30 and x["gradsync_us"] > 0 and x["torch_us"] > 0
        assert x["ratio"] == pytest.approx(x["gradsync_us"] / x["torch_us"])
    names = [what for what, _, _, _ in figure_rows(r)]
    assert len(names) == 6 and names[0].startswith("(e) allreduce 4 B latency"), names
    assert "(e) allreduce 4 KiB latency" in stdout
