"""Launch cost: seconds from starting the launcher to the first completed
allreduce on every rank (the slowest rank's), for a 4-rank world:

  torchrun + gradsync   singletons joined through torch's store (issue 29)
  mpiexec + gradsync    MPI's own world
  torchrun + gloo       torch's CPU reference

``python -m bench.launch [--ranks 4] [--repeats 5]`` from the repository's
root (not under mpiexec: it starts the launchers itself) prints one row per
launcher, median / min / max over the repeats; docs/PERFORMANCE.md
("Launch") holds the results. Each rank also records when its
init_process_group returned, to show the join's share.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(backend, out_dir):
    import torch
    import torch.distributed as dist

    if backend == "gradsync":
        import gradsync.torch.distributed  # noqa: F401
    dist.init_process_group(backend)
    t_init = time.time()
    x = torch.ones(1)
    dist.all_reduce(x)
    t_first = time.time()
    assert x.item() == dist.get_world_size()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{t_init} {t_first}\n")
    dist.destroy_process_group()


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(TOP, "pyx"), TOP])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _mpiexec():
    near = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return near if os.path.exists(near) else shutil.which("mpiexec")


def launch(kind, ranks):
    """(seconds to the slowest rank's first allreduce, to its init) for one launch."""
    out = tempfile.mkdtemp(prefix="gs-launch-")
    me = [sys.executable, "-m", "bench.launch", "--worker"]
    if kind == "mpiexec+gradsync":
        cmd = [_mpiexec(), "-n", str(ranks)] + me + ["gradsync", out]
    else:
        backend = kind.split("+")[1]
        # --log-dir: else torchrun's agent leaves TMPDIR/torchelastic_* behind
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", "--log-dir=" + os.path.join(out, "torchrun-logs"),
               "-m", "bench.launch", "--worker", backend, out]
    t0 = time.time()
    try:
        subprocess.run(cmd, env=_env(), cwd=TOP, check=True, capture_output=True, timeout=600)
        stamps = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}")) as f:
                stamps.append([float(v) for v in f.read().split()])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return max(s[1] for s in stamps) - t0, max(s[0] for s in stamps) - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default="torchrun+gradsync,mpiexec+gradsync,torchrun+gloo")
    ap.add_argument("--worker", nargs=2, metavar=("BACKEND", "OUT_DIR"))
    args = ap.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    kinds = args.kinds.split(",")
    results = {k: [] for k in kinds}
    for _ in range(args.repeats):  # interleaved, so load drifts hit every kind alike
        for k in kinds:
            results[k].append(launch(k, args.ranks))
    print(f"| launcher ({args.ranks} ranks) | first allreduce: median s | min | max | "
          "init returned: median s |")
    print("|---|---|---|---|---|")
    for k in kinds:
        first = [r[0] for r in results[k]]
        init = [r[1] for r in results[k]]
        print(f"| {k} | {statistics.median(first):.2f} | {min(first):.2f} | {max(first):.2f} "
              f"| {statistics.median(init):.2f} |")


if __name__ == "__main__":
    main()
