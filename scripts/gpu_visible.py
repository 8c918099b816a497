#!/usr/bin/env python3
"""Fails (exit 1) when nvidia-smi lists GPUs but gradsync sees none, printing
gradsync's reason (build_info()['cuda_error'], e.g. a driver older than the
CUDA runtime gradsync was built with): `make gpu-test` must not report
"skipped" on a machine that has GPUs. Exit 0 otherwise. NVIDIA_SMI names the
command (default: nvidia-smi on PATH)."""
import os
import shutil
import subprocess
import sys


def listed_gpus(smi):
    """The lines of `nvidia-smi -L` that name a GPU (none without the tool)."""
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.splitlines() if line.startswith("GPU ")]


def main():
    smi = os.environ.get("NVIDIA_SMI") or shutil.which("nvidia-smi")
    gpus = listed_gpus(smi)
    if not gpus:
        return 0
    import gradsync as gs
    info = gs.build_info()
    if info["cuda_devices"] > 0:
        return 0
    why = info.get("cuda_error") or ("this gradsync was built without CUDA (no nvcc at build "
                                     "time)" if not info["cuda_archs"] else "no reason given")
    print(f"gpu-test: nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}), but gradsync sees "
          f"none: {why}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
