#!/usr/bin/env python3
"""Runs Horovod's own PyTorch examples, unchanged, against gradsync.horovod.

Like scripts/horovod_conformance.py, this takes a Horovod checkout (a work
tree or a git directory) and exports what it runs into a temporary folder:
examples/pytorch/pytorch_synthetic_benchmark.py and pytorch_mnist.py. The
scripts are not edited; ``import horovod`` and ``import horovod.torch``
resolve to gradsync's drop-in through the opt-in alias on PYTHONPATH, and
only their command-line arguments are chosen here (a small model and few
batches, so that a 2-core CPU finishes in minutes)::

    python3 scripts/horovod_examples.py --horovod ~/src/horovod --ranks 2

The examples need torchvision (models, and the MNIST dataset class). The
MNIST example downloads its data unless the files are already there: this
script writes MNIST-format files (IDX, the four names torchvision looks for)
of generated digits, ten fixed patterns plus noise, so the job needs no
network and a trained model must beat chance by far: the run fails unless
the test accuracy the example prints reaches ``--min-accuracy``.

The MNIST example also runs as its own launcher (``--num-proc N``: one
plain process calls ``horovod.run(main, np=N)``). Every job must exit 0 on
every rank within ``--timeout``; the synthetic benchmark must print its
total images per second.
"""
import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from horovod_conformance import common_arguments, prepare  # noqa: E402

EXAMPLES = ("examples/pytorch/pytorch_synthetic_benchmark.py",
            "examples/pytorch/pytorch_mnist.py")
SYNTHETIC = ["--model", "resnet18", "--batch-size", "8", "--num-warmup-batches", "2",
             "--num-batches-per-iter", "2", "--num-iters", "3"]


def write_mnist(folder, n_train, n_test, seed=0):
    """MNIST's four IDX files under folder/MNIST/raw (torchvision's names),
    holding generated 28x28 digits: class c is a fixed random pattern plus
    noise, so the classes are separable and a trained model is checkable."""
    rng = np.random.default_rng(seed)
    patterns = (rng.random((10, 28, 28)) > 0.7).astype(np.float64) * 200.0
    raw = os.path.join(folder, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = patterns[labels] + rng.normal(0.0, 40.0, size=(n, 28, 28))
        images = np.clip(images, 0, 255).astype(np.uint8)
        with open(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        with open(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 2049, n) + labels.tobytes())


def run(cmd, env, cwd, timeout):
    """(exit status, output, seconds); a job past its timeout is killed
    with its process group and reported as a hang (status None)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - t0


def judge(kind, rc, out, min_accuracy):
    """A job's verdict and the figure it printed."""
    if rc is None:
        return "hung", ""
    if rc != 0:
        return "failed", (out.strip().splitlines() or ["(no output)"])[-1][:160]
    if kind == "synthetic":
        m = re.search(r"Total img/sec on (\d+) CPU\(s\): ([\d.]+)", out)
        return ("passed", f"{m.group(2)} img/s on {m.group(1)}") if m else \
            ("failed", "no 'Total img/sec' line")
    acc = [float(a) for a in re.findall(r"Accuracy: ([\d.]+)%", out)]
    if not acc:
        return "failed", "no test accuracy printed"
    verdict = "passed" if acc[-1] >= min_accuracy else "failed"
    return verdict, f"test accuracy {acc[-1]:.2f}% (needs {min_accuracy}%)"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(p, "gs-hvd-examples-")
    p.add_argument("--ranks", default="2")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--mnist-train", type=int, default=24000)
    p.add_argument("--mnist-test", type=int, default=1000)
    p.add_argument("--min-accuracy", type=float, default=80.0)
    args = p.parse_args(argv)

    root, env = prepare(args, EXAMPLES)
    data = os.path.join(root, "data")
    write_mnist(data, args.mnist_train, args.mnist_test)
    # pytorch_mnist.py takes a FileLock in the home folder around the download
    env["HOME"] = root
    folder = os.path.join(root, "examples", "pytorch")
    mnist = ["--epochs", "1", "--data-dir", data, "--log-interval", "40"]
    jobs = [("synthetic", "pytorch_synthetic_benchmark.py", SYNTHETIC),
            ("synthetic", "pytorch_synthetic_benchmark.py", SYNTHETIC + ["--fp16-allreduce"]),
            ("synthetic", "pytorch_synthetic_benchmark.py", SYNTHETIC + ["--use-adasum"]),
            ("mnist", "pytorch_mnist.py", mnist),
            ("mnist", "pytorch_mnist.py", mnist + ["--fp16-allreduce"]),
            ("mnist", "pytorch_mnist.py", mnist + ["--use-adasum"]),
            # its own launcher: horovod.run(main, np=N) from one plain process
            ("mnist", "pytorch_mnist.py", mnist + ["--num-proc"])]
    failures = 0
    try:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for kind, script, extra in jobs:
                if extra[-1] == "--num-proc":
                    extra = extra + [str(ranks)]
                    cmd = [args.python, script] + extra
                else:
                    cmd = [args.mpiexec, "-n", str(ranks), args.python, script] + extra
                rc, out, secs = run(cmd, env, folder, args.timeout)
                verdict, figure = judge(kind, rc, out, args.min_accuracy)
                failures += verdict != "passed"
                print(f"{ranks} ranks {verdict:6s} {secs:6.1f} s  {script} {' '.join(extra)}"
                      f"\n    {figure}", flush=True)
                if args.verbose or verdict != "passed":
                    print(out[-4000:], flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
