"""scripts/gpu_visible.py, which `make gpu-test` runs first: a machine whose
nvidia-smi lists GPUs that gradsync cannot see (a driver older than the CUDA
runtime gradsync was built with, a CPU-only build) must fail, with the
reason, instead of reporting the GPU tests as skipped."""
import os
import stat

import gradsync as gs
from gsutil import collectively, run_child

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts", "gpu_visible.py")
RUN = ("import runpy, sys; sys.argv = [sys.argv[1]]; "
       "runpy.run_path(sys.argv[0], run_name='__main__')")


def fake_smi(tmp_path, listing):
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\nprintf '%s'\n" % listing)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def run(smi):
    return run_child(RUN, {"NVIDIA_SMI": smi}, args=(SCRIPT,))


def test_fails_when_nvidia_smi_lists_gpus_gradsync_cannot_see(tmp_path):
    with collectively():
        smi = fake_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\n")
        p = run(smi)
        if gs.build_info()["cuda_devices"] == 0:
            assert p.returncode == 1, (p.stdout, p.stderr)
            assert "lists 1 GPU" in p.stderr and "gradsync sees none" in p.stderr, p.stderr
        else:
            assert p.returncode == 0, p.stderr


def test_passes_when_nvidia_smi_lists_none(tmp_path):
    with collectively():
        p = run(fake_smi(tmp_path, "No devices were found\\n"))
        assert p.returncode == 0, p.stderr
        p = run(str(tmp_path / "no-such-nvidia-smi"))
        assert p.returncode == 0, p.stderr
