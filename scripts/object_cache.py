"""A content-addressed cache of compiled objects for setup.py
(GRADSYNC_OBJECT_CACHE=DIR), in the manner of ccache's preprocessor mode.

`make` builds the library in place with the cache in build/object-cache;
`make test` then builds the wheel `pip install .` would build, from a clean
copy of the sources in pip's isolated environment, with the same cache: a
source whose compile has the same key reuses the in-place object instead of
compiling again (2.5 minutes of one of two cores, for the same bytes).

The key of a C compile is the compiler's identity (its `--version`), its
flags other than -D, -I and -isystem, and the source as the preprocessor
makes it with those (-E -P): what the compiler reads, wherever the tree or
the build environment's headers lie. A changed source, header, define,
flag or compiler misses. nvcc's preprocessing differs per target, so a .cu
file's key is its flags (the tree's root written as <root>) and the bytes
of it and of every header under src/ and include/. Objects made with -g
keep the first tree's paths in their debug information; nothing else of
them depends on where they were built.
"""
import glob
import hashlib
import os
import shutil
import subprocess

_VERSIONS = {}


def _identity(compiler):
    if compiler not in _VERSIONS:
        try:
            out = subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            out = b"unknown " + compiler.encode()
        _VERSIONS[compiler] = out
    return _VERSIONS[compiler]


def _kept_flags(args, root):
    """The flags the preprocessed text does not already reflect."""
    return [a.replace(root, "<root>") for a in args
            if not a.startswith(("-D", "-I", "-isystem"))]


def _tree_headers(root):
    h = hashlib.sha256()
    for pattern in ("include/*.h", "src/*/*.h", "src/*/*/*.h", "src/*/*.cuh"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.digest()


def key(compiler_args, src, root):
    """The cache key of compiling `src` with `compiler_args` (the command
    without "-c SRC -o OBJ"); None when the source cannot be preprocessed."""
    h = hashlib.sha256(_identity(compiler_args[0]))
    h.update("\0".join(_kept_flags(compiler_args[1:], root)).encode())
    if src.endswith(".cu"):
        h.update(os.path.relpath(src, root).encode())
        with open(src, "rb") as f:
            h.update(f.read())
        h.update(_tree_headers(root))
        return h.hexdigest()
    cpp = [a for a in compiler_args if a not in ("-g",)] + ["-E", "-P", src]
    try:
        h.update(subprocess.run(cpp, capture_output=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError):
        return None
    return h.hexdigest()


def split(cmd):
    """(compiler args, source, object) of a "... -c SRC -o OBJ" command."""
    i, j = cmd.index("-c"), cmd.index("-o")
    rest = [a for k, a in enumerate(cmd) if k not in (i, i + 1, j, j + 1)]
    return rest, cmd[i + 1], cmd[j + 1]


def fetch(cache, k, obj):
    """Copies the cached object `k` to obj; whether it was there."""
    path = os.path.join(cache, k + ".o")
    if not os.path.exists(path):
        return False
    os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
    shutil.copyfile(path, obj)
    os.utime(path)  # used now: kept by prune()
    return True


def store(cache, k, obj):
    os.makedirs(cache, exist_ok=True)
    tmp = os.path.join(cache, f".{k}.{os.getpid()}.tmp")
    shutil.copyfile(obj, tmp)
    os.replace(tmp, os.path.join(cache, k + ".o"))


def prune(cache, keep_days=7):
    """Drops objects no build used for keep_days (a checkout's cache only
    grows by what each edit of its sources changes)."""
    import time

    limit = time.time() - keep_days * 86400
    for path in glob.glob(os.path.join(cache, "*.o")):
        if os.path.getmtime(path) < limit:
            os.remove(path)


def run(cmd, cache, root, spawn):
    """Runs compile command `cmd` through the cache: `spawn(cmd)` on a miss
    (then stores the object), a copy on a hit. Returns whether it hit."""
    if not cache:
        spawn(cmd)
        return False
    args, src, obj = split(cmd)
    k = key(args, src, root)
    if k and fetch(cache, k, obj):
        return True
    spawn(cmd)
    if k:
        store(cache, k, obj)
    return False
