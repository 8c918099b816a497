"""Frameworks nobody here wrote, on the gradsync backend (issue 46 item 3;
docs/TORCH_BACKEND.md "Frameworks"): each recipe under recipes/ runs under
torchrun at 2 ranks twice, once on gloo (the framework's own choice on the
CPU) and once as the docs tell gradsync users to run it, and every rank's
parameters after training, losses and step counts must be equal bit for bit.

The frameworks are installed by `make framework-test` (versions pinned there
and in the docs); a framework that is not installed skips its test. Runs at
one MPI rank (it starts its own processes). Everything a run writes stays
under tmp_path.
"""
import importlib.util
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(HERE, "recipes")
TOP = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(TOP, "tests", "python"))
from launch_env import singleton_env  # noqa: E402  (os only: no MPI in this process)

LAUNCH_SECONDS = 600


def _env(tmp_path):
    # DeepSpeed JIT-builds a CPU op into TORCH_EXTENSIONS_DIR; HF caches
    return singleton_env(RECIPES, TORCH_EXTENSIONS_DIR=tmp_path / "torch_extensions",
                         HF_HOME=tmp_path / "hf_home", TMPDIR=tmp_path)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, recipe, backend, extra=()):
    out = tmp_path / backend
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           f"--log-dir={tmp_path / ('logs-' + backend)}", os.path.join(RECIPES, recipe),
           backend, str(out), *extra]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=LAUNCH_SECONDS, cwd=str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{recipe} on {backend} failed:\n{log[-6000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _needs(module):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (make framework-test installs it)")


CASES = [
    pytest.param("accelerate_recipe.py", (), marks=_needs("accelerate"), id="accelerate"),
    pytest.param("hf_trainer_recipe.py", (), marks=_needs("transformers"), id="hf-trainer"),
    pytest.param("lightning_recipe.py", (), marks=_needs("lightning"), id="lightning"),
    pytest.param("deepspeed_recipe.py", ("0",), marks=_needs("deepspeed"), id="deepspeed"),
]


@pytest.mark.parametrize("recipe,extra", CASES)
def test_recipe_matches_gloo(tmp_path, recipe, extra):
    gloo = _launch(tmp_path, recipe, "gloo", extra)
    ours = _launch(tmp_path, recipe, "gradsync", extra)
    for rank in range(2):
        ref, got = gloo[rank], ours[rank]
        assert (ref["backend"], got["backend"]) == ("gloo", "gradsync")
        assert (got["rank"], got["size"]) == (rank, 2)
        assert ref["extra"]["steps"] > 0 and ref["extra"] == got["extra"]
        assert ref["params"].keys() == got["params"].keys()
        for name, value in ref["params"].items():
            assert torch.equal(value, got["params"][name]), (recipe, rank, name)
