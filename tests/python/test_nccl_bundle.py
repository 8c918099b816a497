"""The carried NCCL's tools (scripts/build_nccl.sh, scripts/nccl_bundle.py;
issue 50), without a GPU: a mistake in them costs a GPU session.

- the fatbinary reader names the architectures nvcc compiled into
  libgradsync.so: the same set the build reports (build_info's
  cuda_archs, written from the nvcc flags, an independent record);
- `check` refuses a library older than asked or built for other
  architectures, and accepts one that matches;
- `--pack` then `unpack` give back the same bytes, and unpack refuses a
  bundle whose bytes differ from its MANIFEST's sha1.
"""
import hashlib
import lzma
import os
import shutil
import subprocess
import sys

import pytest

import gradsync as gs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import nccl_bundle  # noqa: E402

LIB = os.path.join(os.path.dirname(gs.__file__), "libgradsync.so")
EMULATED = os.path.join(ROOT, "build", "emulated", "libgradsync.so")
CUDA_ARCHS = gs.build_info().get("cuda_archs")


def _names(archs):
    """build_info's "sm_80,sm_90,compute_90" in the reader's names."""
    return {a.replace("compute_", "ptx_") for a in archs.split(",")}


@pytest.mark.skipif(not CUDA_ARCHS or CUDA_ARCHS == "emulated",
                    reason="gradsync built without nvcc: no GPU code to read")
def test_architectures_match_what_the_build_compiled():
    assert nccl_bundle.architectures(LIB) == _names(CUDA_ARCHS)


def test_a_library_without_gpu_code_is_named(tmp_path):
    with pytest.raises(ValueError, match="no .nv_fatbin"):
        nccl_bundle.fatbin_section(sys.executable)
    text = tmp_path / "t.txt"
    text.write_text("not an ELF")
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        nccl_bundle.fatbin_section(str(text))


needs_emulated = pytest.mark.skipif(not os.path.exists(EMULATED),
                                    reason="the emulated NCCL (make test-emulated) is not built")


def _run(args, **env):
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=120)


@needs_emulated
def test_check_refuses_an_old_version_and_accepts_a_new_one():
    script = os.path.join(ROOT, "scripts", "nccl_bundle.py")
    old = _run([sys.executable, script, "check", EMULATED, "--arch", "0"],
               GS_EMU_NCCL_VERSION="22809")
    assert old.returncode == 1 and "version 22809 is older than 23000" in old.stderr
    assert "version 2.28.9 (22809)" in old.stdout
    new = _run([sys.executable, script, "check", EMULATED, "--arch", "0"],
               GS_EMU_NCCL_VERSION="23007")
    assert new.returncode == 0, new.stderr
    # asked for sm_90 code, the emulated library has none
    arch = _run([sys.executable, script, "check", EMULATED, "--arch", "90"],
                GS_EMU_NCCL_VERSION="23007")
    assert arch.returncode != 0 and "nv_fatbin" in arch.stderr


@needs_emulated
def test_pack_then_unpack_gives_the_same_bytes_and_refuses_other_bytes(tmp_path):
    bundle = tmp_path / "bundle"
    packed = _run(["bash", "scripts/build_nccl.sh", "--pack", EMULATED], GS_NCCL_ARCH="0",
                  GS_EMU_NCCL_VERSION="23007", GS_NCCL_OUT=str(bundle))
    assert packed.returncode == 0, packed.stderr
    manifest = nccl_bundle.manifest(str(bundle))
    assert manifest["version"].startswith("2.30.7")
    # the MANIFEST's sha1 is of the stripped library: the bytes that travel
    with lzma.open(bundle / "libnccl.so.2.xz") as f:
        assert hashlib.sha1(f.read()).hexdigest() == manifest["sha1"]
    assert int(manifest["xz_bytes"]) == os.path.getsize(bundle / "libnccl.so.2.xz")
    assert sorted(os.listdir(bundle)) == ["MANIFEST", "libnccl.so.2.xz"]

    dest = tmp_path / "dest"
    assert nccl_bundle.main(["unpack", str(bundle), str(dest)]) == 0
    assert nccl_bundle.sha1(str(dest / "libnccl.so.2")) == manifest["sha1"]

    # a bundle whose bytes are not the MANIFEST's: refused, nothing left behind
    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    with lzma.open(other / "libnccl.so.2.xz", "wb") as f:
        f.write(b"other bytes")
    dest2 = tmp_path / "dest2"
    assert nccl_bundle.main(["unpack", str(other), str(dest2)]) == 1
    assert os.listdir(dest2) == []


@needs_emulated
def test_the_bundle_limit_is_enforced(tmp_path):
    """A bundle over GS_NCCL_MAX_MIB fails the script, naming the limit."""
    r = _run(["bash", "scripts/build_nccl.sh", "--pack", EMULATED], GS_NCCL_ARCH="0",
             GS_EMU_NCCL_VERSION="23007", GS_NCCL_MAX_MIB="0",
             GS_NCCL_OUT=str(tmp_path / "b"))
    assert r.returncode == 1 and "over the 0 MiB limit" in r.stderr
