"""README.md's code runs as written, and the docs name only what the tree has
(issue 44 item 6).

- A ```python block runs: under ``mpiexec -n N`` when its first line is the
  comment ``# mpiexec -n N python NAME.py`` (else at one rank), as NAME.py
  in a folder outside the checkout, with PYTHONPATH naming only the package
  this test imports; it must exit 0. Blocks that import torch (or jax) are
  skipped where it is not importable. A block that is not meant to run
  (undefined names, a GPU) says so with ``<!-- fragment ... -->`` on the
  line before it; an unmarked block that does not run fails.
- A ```sh block is checked, not run (``make test`` takes many minutes):
  every ``make TARGET`` is a target of the Makefile, every
  ``python -m MODULE`` imports (bench.* from the checkout's root, where the
  README says to run them), every ``scripts/X`` exists. The same holds for
  the commands written inline in the README's text.
- A ```c block is an excerpt of one of tests/c/example_*.c: its lines appear
  there in the same order (a line ``/* ... */`` stands for lines left out).
- docs/GUIDE.md's python blocks that carry the ``# mpiexec`` line run too.
- Paths the README and docs/*.md name (docs/X.md, scripts/X, src/a/b.c,
  tests/..., pyx/..., bench/..., include/...) exist, build outputs aside.

The blocks' jobs run one after another from rank 0 of a 1-rank pytest job
(they start their own mpiexec); at more ranks the module is skipped, so
`make test`'s 2-4 rank passes do not repeat it.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from mpi4py import MPI

import gradsync as gs

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPI.COMM_WORLD.size > 1,
                       reason="runs its own mpiexec jobs: in the 1-rank pass only"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
GUIDE = os.path.join(ROOT, "docs", "GUIDE.md")
DOCS = os.path.join(ROOT, "docs")
# The folder gradsync was imported from: the blocks run against this package.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(gs.__file__)))

FENCE = re.compile(r"^( *)```(\S*)\s*$")
HEADER = re.compile(r"^# mpiexec -n (\d+) python (\S+\.py)\b")
FRAGMENT = re.compile(r"^\s*<!-- fragment\b")
# Launcher variables of the pytest job itself: a child mpiexec must not see them.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "I_MPI_")


class Block:
    def __init__(self, path, line, lang, text, fragment):
        self.path, self.line, self.lang, self.text, self.fragment = (
            path, line, lang, text, fragment)

    @property
    def where(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def read_blocks(path):
    """The fenced blocks of a Markdown file (indented ones, inside list items,
    included), each with its opening line number and whether the line
    before it marks it a fragment."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = next((x for x in reversed(lines[:start]) if x.strip()), "")
        blocks.append(Block(path, start + 1, lang, textwrap.dedent("\n".join(body)) + "\n",
                            bool(FRAGMENT.match(before))))
        i += 1
    return blocks


def _mpiexec():
    near = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return os.environ.get("MPIEXEC") or (near if os.path.exists(near)
                                         else shutil.which("mpiexec"))


def _child_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = PACKAGE_PARENT
    # oversubscribed ranks yield, as in make test (MPICH; other MPIs ignore these)
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "10")
    return env


def _needs(block):
    """The optional packages a block imports that are not importable here."""
    wanted = set(re.findall(r"^\s*(?:import|from)\s+(torch|jax)\b", block.text, re.M))
    if re.search(r"\bgradsync\.(torch|horovod)\b", block.text):
        wanted.add("torch")
    return sorted(w for w in wanted if importlib.util.find_spec(w) is None)


def run_block(block, tmp_path):
    header = HEADER.match(block.text)
    ranks, name = (int(header.group(1)), header.group(2)) if header else (1, "block.py")
    script = tmp_path / name
    script.write_text(block.text)
    assert not str(tmp_path).startswith(ROOT + os.sep)
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, name]
    try:
        p = subprocess.run(cmd, cwd=str(tmp_path), env=_child_env(), capture_output=True,
                           text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where}: {' '.join(cmd)} hung (300 s)\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, (
        f"{block.where}: `mpiexec -n {ranks} python {name}` exited {p.returncode}. "
        f"If the block is not meant to run, put <!-- fragment --> on the line before it.\n"
        f"--- the block:\n{block.text}--- output:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


# ---- the README's blocks ------------------------------------------------------

README_BLOCKS = read_blocks(README)


def test_the_readme_has_blocks_of_each_kind():
    langs = {b.lang for b in README_BLOCKS}
    assert {"python", "sh", "c"} <= langs, langs
    assert all(b.lang in ("python", "sh", "c") for b in README_BLOCKS), \
        [(b.where, b.lang) for b in README_BLOCKS if b.lang not in ("python", "sh", "c")]
    # the runnable ones are most of them
    runnable = [b for b in README_BLOCKS if b.lang == "python" and not b.fragment]
    assert len(runnable) >= 4, [b.where for b in runnable]


PY_BLOCKS = [b for b in README_BLOCKS if b.lang == "python"]


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[b.where for b in PY_BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    if block.fragment:
        pytest.skip(f"{block.where} is marked a fragment")
    missing = _needs(block)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}")
    run_block(block, tmp_path)


# ---- commands: make targets, modules, scripts ----------------------------------

def make_targets():
    """Every target the Makefile defines, from make's own database (-p; -q
    runs no recipe, and the default goal's recipes hold no $(MAKE))."""
    p = subprocess.run(["make", "-C", ROOT, "-pq", "--no-print-directory"],
                       capture_output=True, text=True, timeout=120, env=_child_env())
    targets = set()
    for line in p.stdout.splitlines():
        m = re.match(r"^([A-Za-z0-9][\w.-]*(?: [\w./-]+)*):(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    assert {"test", "build"} <= targets, p.stdout[-2000:] + p.stderr[-2000:]
    return targets


def module_exists(name):
    """`python -m name` would find it: gradsync's modules in this package,
    bench.* in the checkout (run from its root)."""
    if name.split(".")[0] == "bench":
        return os.path.exists(os.path.join(ROOT, *name.split(".")) + ".py") or \
            os.path.exists(os.path.join(ROOT, *name.split("."), "__main__.py"))
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package: needs __main__
        return importlib.util.find_spec(name + ".__main__") is not None
    return True


MAKE_RE = re.compile(r"\bmake((?:[ \t]+[A-Z_]+=\S+)*)((?:[ \t]+[a-z][\w-]*)*)")
MODULE_RE = re.compile(r"\bpython3? -m ([\w.]+)")
SCRIPT_RE = re.compile(r"(?<![\w/.])(scripts/[\w.-]+)")
# Standard modules and tools the commands name, not ours.
OTHER_MODULES = {"pip", "venv", "mpi4py", "pytest"}


def commands_of(text):
    """(make targets, modules, scripts) a piece of shell or prose names."""
    targets, modules, scripts = set(), set(), set()
    for m in MAKE_RE.finditer(text):
        targets.update(m.group(2).split())
    for m in MODULE_RE.finditer(text):
        if m.group(1) not in OTHER_MODULES and not m.group(1).endswith(".NAME"):
            modules.add(m.group(1))
    scripts.update(SCRIPT_RE.findall(text))
    return targets, modules, scripts


def _inline_commands(path):
    """The commands written in a file's text outside fenced blocks: the
    `backticked` spans that start with make, python or scripts/."""
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", text)
    return "\n".join(s for s in spans
                     if re.match(r"(make\b|python3? -m |mpiexec |scripts/)", s))


def check_commands(text, where, targets):
    want_targets, modules, scripts = commands_of(text)
    problems = [f"make {t}: no such target in the Makefile" for t in sorted(want_targets)
                if t not in targets and not t.endswith(".")]
    problems += [f"python -m {m}: no such module" for m in sorted(modules)
                 if not module_exists(m)]
    problems += [f"{s}: no such file" for s in sorted(scripts)
                 if not os.path.exists(os.path.join(ROOT, s.rstrip(".")))]
    assert not problems, f"{where}:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def targets():
    return make_targets()


SH_BLOCKS = [b for b in README_BLOCKS if b.lang == "sh"]


@pytest.mark.parametrize("block", SH_BLOCKS, ids=[b.where for b in SH_BLOCKS])
def test_readme_sh_block_names_what_exists(block, targets):
    assert any(commands_of(block.text)), f"{block.where}: no command recognized"
    check_commands(block.text, block.where, targets)


def test_readme_inline_commands_name_what_exists(targets):
    text = _inline_commands(README)
    assert "make demo" in text and "bench.overlap" in text, text
    check_commands(text, "README.md (inline)", targets)


def test_the_checkers_catch_a_missing_name(targets):
    with pytest.raises(AssertionError, match="no-such-target"):
        check_commands("make no-such-target", "x", targets)
    with pytest.raises(AssertionError, match="gradsync.no_such_module"):
        check_commands("python -m gradsync.no_such_module", "x", targets)
    with pytest.raises(AssertionError, match="scripts/no_such"):
        check_commands("scripts/no_such --flag", "x", targets)
    with pytest.raises(AssertionError, match="bench.nothing"):
        check_commands("python -m bench.nothing", "x", targets)
    check_commands("make test && python -m gradsync.bench -b 8 && scripts/gsbench", "x",
                   targets)


# ---- C excerpts ----------------------------------------------------------------

ELISION = "/* ... */"


def _c_lines(text):
    return [" ".join(x.split()) for x in text.splitlines() if x.strip()]


def _not_in_order(want, have):
    """The lines of want (elisions aside) that are not found in have after
    the line before them."""
    missing, at = [], 0
    for line in want:
        if line == ELISION:
            continue
        try:
            at = have.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


C_BLOCKS = [b for b in README_BLOCKS if b.lang == "c"]


@pytest.mark.parametrize("block", C_BLOCKS, ids=[b.where for b in C_BLOCKS])
def test_readme_c_block_is_an_excerpt_of_an_example(block):
    examples = sorted(os.path.join(ROOT, "tests", "c", f)
                      for f in os.listdir(os.path.join(ROOT, "tests", "c"))
                      if f.startswith("example_") and f.endswith(".c"))
    assert examples
    want = _c_lines(block.text)
    missing = {}
    for path in examples:
        have = _c_lines(open(path, encoding="utf-8").read())
        missing[os.path.relpath(path, ROOT)] = _not_in_order(want, have)
        if not missing[os.path.relpath(path, ROOT)]:
            return
    pytest.fail(f"{block.where}: lines not in any tests/c/example_*.c in this order (the "
                f"README's C code is an excerpt of a tested example): {missing}")


def test_the_excerpt_check_sees_order_and_elisions():
    have = ["a;", "b;", "}", "c;", "}"]
    assert _not_in_order(["a;", ELISION, "c;", "}"], have) == []
    assert _not_in_order(["c;", "a;"], have) == ["a;"]
    assert _not_in_order(["d;"], have) == ["d;"]


# ---- docs/GUIDE.md: the blocks that say how they run ---------------------------

GUIDE_RUNNABLE = [b for b in read_blocks(GUIDE)
                  if b.lang == "python" and HEADER.match(b.text) and not b.fragment]


def test_the_guide_has_runnable_blocks():
    assert GUIDE_RUNNABLE


@pytest.mark.parametrize("block", GUIDE_RUNNABLE, ids=[b.where for b in GUIDE_RUNNABLE])
def test_guide_python_block_runs(block, tmp_path):
    missing = _needs(block)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}")
    run_block(block, tmp_path)


# ---- paths named in the README and docs ----------------------------------------

PATH_RE = re.compile(r"(?<![\w./-])((?:docs|scripts|src|include|tests|bench|pyx)/[\w./*-]*[\w*])")
# Made by a build or a run, not kept in the tree.
GENERATED = ("tests/c/bin", "pyx/gradsync/libgradsync.so", "pyx/gradsync/_core")
# Named on purpose though not ours: NCCL's folder, in docs/decisions/python.md's comparison.
NOT_OURS = {"src/misc"}


def named_paths(path):
    """(line, path) for each repository path a file names."""
    out = []
    for n, line in enumerate(open(path, encoding="utf-8").read().splitlines(), 1):
        for m in PATH_RE.finditer(line):
            out.append((n, m.group(1).rstrip(".")))
    return out


def _exists(p):
    if "*" in p:
        import glob
        return bool(glob.glob(os.path.join(ROOT, p)))
    return os.path.exists(os.path.join(ROOT, p))


DOC_FILES = [README] + sorted(
    os.path.join(folder, f) for folder in (DOCS, os.path.join(DOCS, "decisions"))
    for f in os.listdir(folder) if f.endswith(".md"))


@pytest.mark.parametrize("doc", DOC_FILES, ids=[os.path.relpath(d, ROOT) for d in DOC_FILES])
def test_docs_name_only_files_the_tree_has(doc):
    stale = [f"{os.path.relpath(doc, ROOT)}:{n}: {p}" for n, p in named_paths(doc)
             if not p.startswith(GENERATED) and p not in NOT_OURS and not _exists(p)]
    assert not stale, "paths that do not exist (renamed? git log --follow):\n" + "\n".join(stale)


def test_docs_link_only_docs_that_exist():
    """Relative Markdown links ([text](X.md), [text](docs/X.md#part))."""
    bad = []
    for doc in DOC_FILES:
        text = open(doc, encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
            if not os.path.exists(os.path.join(os.path.dirname(doc), target)):
                bad.append(f"{os.path.relpath(doc, ROOT)}: ({target})")
    assert not bad, bad
