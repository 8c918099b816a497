#!/usr/bin/env python3
"""Checks src/'s layering from the compiler's own call graph.

Every C file of src/ is compiled with gcc's -fcallgraph-info (the .cu file's
host side with g++ over the same flags, its kernels being leaves), which
lists each function a file defines and each function it calls. src/ has one
folder per layer, and a file's first folder under src/ is its layer (LAYERS
below, bottom first): a layer's parts may have subfolders of their own
(transport/mpi/, transport/nccl/), which are the same layer. The check fails when
- a call goes up: a function in one layer calls one defined in a higher one;
- files call each other in a cycle (within a layer too);
- a private header includes one of a higher layer, or headers include each
  other in a cycle;
- a C file is longer than MAX_FILE_LINES, or a function than MAX_FUNCTION_LINES;
- a file of src/ sits in no layer's folder.
Calls through function pointers (the transport table, queued jobs) are not
calls in this graph: they are how a lower layer runs what a higher one gave
it. The layer table is printed with each file's outgoing calls by layer.

The Python package is checked the same way from its import statements
(PY_LAYERS below): a module imports its own layer or lower ones, modules
import each other in no cycle, and no function imports `MPI` from gradsync
(a module-level import works everywhere: gradsync/__init__ loads mpi4py first).

Usage: check_layers.py [--cc MPICC] [--quiet]; exit status 1 on a violation.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(TOP, "src")

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# The layers, bottom first: each is a folder of src/, and the folder a file
# sits in is its layer (this ordered list is the only table). A file calls
# its own layer or lower ones; headers likewise include their own or lower.
LAYERS = [
    ("base", "status and last error, logging, every environment knob, dtypes, the clock, "
     "hashes, the timeline recorder"),
    ("kernels", "host kernels; CUDA kernels and their launchers (pure computation)"),
    ("runtime", "the runtime lock, a communicator's fate, the one wait loop"),
    ("device", "CUDA contexts, streams, events, memory, the kernel-table ring, kernel "
     "tables, the kernels on CUDA memory"),
    ("mpi", "the communicator's state, MPI types and ops, the MPI wait, recursive doubling"),
    ("transport", "one gs_transport_t per way of moving data; hosts and the hierarchical "
     "allreduce; MPI's exchange collectives"),
    ("engine", "where a call's data lives and which path moves it, its buffers, the fusion "
     "plan, pack and unpack; the background thread, requests, entering the runtime"),
    ("algorithms", "Adasum, and the exchange collectives' data movement, over the "
     "transport and kernel entries"),
    ("comm", "communicators, argument checks, cross-rank validation"),
    ("coll", "the call skeleton, the public collectives, kernels and info, and their "
     "asynchronous entry points"),
]
LAYER_INDEX = {name: k for k, (name, _) in enumerate(LAYERS)}


def rel(path):
    """A source's name as the layer table shows it: 'transport/nccl/nccl.c'."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(SRC))


def layer(name):
    """(index, folder) of a file named as rel() names it, its layer being its first
    folder; (99, '?') outside every layer."""
    folder = name.split("/")[0] if "/" in name else ""
    return (LAYER_INDEX[folder], folder) if folder in LAYER_INDEX else (99, "?")


PYX = os.path.join(TOP, "pyx")

# The Python package's layers, bottom first: (name, what, module prefixes).
PY_LAYERS = [
    ("binding", "the Cython extension and what it needs: MPI start-up, gradsync's world (MPI's "
     "or joined from singletons, shrunk to its survivors, grown by newcomers), argument "
     "helpers, ops",
     ["gradsync._core", "gradsync._mpi", "gradsync._filestore", "gradsync._members",
      "gradsync._rendezvous", "gradsync._world", "gradsync._shrink", "gradsync._grow",
      "gradsync._args",
      "gradsync.ops"]),
    ("compose", "classes over the binding: Communicator, its exchange collectives, arenas, "
     "kernels, partitions, shard layouts, training across a lost rank",
     ["gradsync.exchange", "gradsync.communicator", "gradsync.arena", "gradsync.kernels",
      "gradsync.partition", "gradsync.shard", "gradsync.wire", "gradsync.elastic"]),
    ("package", "import gradsync: the public names", ["gradsync"]),
    ("tools", "gsbench, the installed benchmark", ["gradsync.bench"]),
    ("front doors", "frameworks: JAX, torch (autograd, DistributedOptimizer, the "
     "torch.distributed backend), the Horovod drop-in",
     ["gradsync.jax", "gradsync.torch", "gradsync.horovod"]),
]


def py_modules():
    """{module name: path} of the package's .py files."""
    out = {}
    for path in glob.glob(os.path.join(PYX, "gradsync", "**", "*.py"), recursive=True):
        name = os.path.relpath(path, PYX)[:-3].replace(os.sep, ".")
        out[name[:-9] if name.endswith(".__init__") else name] = path
    for path in glob.glob(os.path.join(PYX, "gradsync", "**", "*.pyx"), recursive=True):
        out[os.path.relpath(path, PYX)[:-4].replace(os.sep, ".")] = None  # Cython: no edges
    return out


def py_layer(module):
    best = (99, "?", "")
    for k, (name, _, prefixes) in enumerate(PY_LAYERS):
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > len(best[2]):
                best = (k, name, pre)
    return best[:2]


def py_imports(modules):
    """[(importer, imported gradsync module, line, nested)] and the problems
    of function-level `from gradsync import MPI`."""
    import ast
    edges, problems = [], []
    for mod, path in modules.items():
        if path is None:
            continue
        tree = ast.parse(open(path).read(), path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        nested = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested |= {id(n) for n in ast.walk(node) if n is not node}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    names.append(full if full in modules else base)
                if base == "gradsync" and id(node) in nested and \
                        any(a.name == "MPI" for a in node.names):
                    problems.append(f"{mod}:{node.lineno} imports MPI from gradsync inside a "
                                    "function: import it at module level")
            for n in names:
                if n.split(".")[0] == "gradsync" and n != mod:
                    target = n
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]
                    if target in modules and target != mod:
                        edges.append((mod, target, node.lineno, id(node) in nested))
    return edges, problems


def check_python(quiet):
    modules = py_modules()
    edges, problems = py_imports(modules)
    for mod in sorted(modules):
        if py_layer(mod)[0] == 99:
            problems.append(f"python: {mod} is in no layer (PY_LAYERS in scripts/check_layers.py)")
    for a, b, line, _ in sorted(set(edges)):
        if py_layer(b)[0] > py_layer(a)[0]:
            problems.append(f"python: import up: {a}:{line} imports {b} "
                            f"({py_layer(a)[1]} -> {py_layer(b)[1]})")
    for comp in cycles({(a, b) for a, b, _, _ in edges}):
        problems.append("python: import cycle among " + ", ".join(comp))
    if not quiet:
        print(f"\n{'python layer':<14} modules")
        for k, (name, what, _) in enumerate(PY_LAYERS):
            mods = sorted(m for m in modules if py_layer(m)[0] == k)
            print(f"{k:>2} {name:<11} {what}")
            for m in mods:
                outs = sorted({b for a, b, _, _ in edges if a == m})
                print(f"     {m:<40} -> {', '.join(outs) or '-'}")
    return problems, len(modules)


DEF = re.compile(r'node: \{ title: "([^"]+)" label: "([^"\\]+)\\n([^:]+):(\d+)')
EDGE = re.compile(r'edge: \{ sourcename: "([^"]+)" targetname: "([^"]+)"')


def call_graph(cc, files, flags):
    """{function: file} of definitions, {(file, function)} of every file's own
    definitions (a static name resolves to its own file first), and
    [(caller file, callee, caller function)] edges."""
    defined, local, edges = {}, set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            compiler = shlex_split(cc)
            if f.endswith(".cu"):
                compiler = ["g++", "-x", "c++", "-std=c++17", "-D__CUDACC__=0"]
            out = os.path.join(tmp, rel(f).replace("/", "__") + ".o")
            cmd = compiler + flags + ["-fcallgraph-info", "-c", f, "-o", out]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if r.returncode != 0:
                if f.endswith(".cu"):  # kernels need nvcc: no host-side edges to read
                    continue
                raise SystemExit(f"check_layers: cannot compile {f}:\n{r.stderr}")
            ci = out[:-2] + ".ci"
            text = open(ci).read() if os.path.exists(ci) else ""
            base = rel(f)
            for title, _, where, _ in DEF.findall(text):
                if rel(where) == base and "shape" not in title:
                    defined.setdefault(title.split(":")[-1], base)
                    local.add((base, title.split(":")[-1]))
            for src, dst in EDGE.findall(text):
                edges.append((base, dst.split(":")[-1], src.split(":")[-1]))
    return defined, local, edges


def shlex_split(s):
    import shlex
    return shlex.split(s)


def includes():
    """[(file, included private header)] for src/ files and headers, both named
    as rel() names them (private includes name their folder: "engine/gs_engine.h")."""
    out = []
    for f in src_files():
        for line in open(f, errors="replace"):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m and os.path.exists(os.path.join(SRC, m.group(1))):
                out.append((rel(f), m.group(1)))
    return out


def src_files():
    """Every file under src/, at any depth, sorted (a layer's subfolders included)."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(SRC) for n in names)


def cycles(edges):
    """Strongly connected components of more than one node (Tarjan)."""
    graph = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def long_functions(path):
    """(name, lines) of top-level function bodies longer than the limit."""
    text = open(path, errors="replace").read()
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    out, depth, start, name = [], 0, None, None
    lines = text.split("\n")
    for i, line in enumerate(lines):
        for ch in line:
            if ch == "{":
                if depth == 0:
                    head = " ".join(lines[max(0, i - 3):i + 1])
                    m = re.search(r"(\w+)\s*\([^;{}]*\)\s*(const\s*)?\{[^{]*$", head)
                    name, start = (m.group(1) if m else None), i
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0 and name and name not in ("if", "for", "while", "switch"):
                    n = i - start + 1
                    if n > MAX_FUNCTION_LINES:
                        out.append((name, n))
                    name = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default=os.environ.get("MPICC") or shutil.which("mpicc") or "mpicc")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    files = [f for f in src_files() if f.endswith((".c", ".cu"))]
    problems = []
    for f in src_files():
        if layer(rel(f))[0] == 99:
            problems.append(f"{rel(f)} is in no layer: every file sits in one of the folders "
                            "of LAYERS in scripts/check_layers.py")
    cuda_inc = os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")
    flags = ["-std=gnu11", "-DGS_BUILDING_LIBRARY", "-I" + os.path.join(TOP, "include"),
             "-I" + SRC]
    if os.path.exists(os.path.join(cuda_inc, "cuda_runtime_api.h")):
        flags += ["-DGS_HAVE_CUDA", "-I" + cuda_inc]
    defined, local, edges = call_graph(args.cc, files, flags)
    file_edges = set()
    up = {}
    for caller, callee, fn in edges:
        target = caller if (caller, callee) in local else defined.get(callee)
        if not target or target == caller:
            continue
        file_edges.add((caller, target))
        if layer(target)[0] > layer(caller)[0]:
            up.setdefault((caller, target), set()).add(f"{fn} -> {callee}")
    for (a, b), calls in sorted(up.items()):
        problems.append(f"call up: {a} calls {b}: " + ", ".join(sorted(calls)[:4]))
    for comp in cycles(file_edges):
        problems.append("call cycle among " + ", ".join(comp))
    inc = includes()
    for a, b in inc:
        if layer(b)[0] > layer(a)[0]:
            problems.append(f"include up: {a} includes {b}")
    for comp in cycles(inc):
        problems.append("include cycle among " + ", ".join(comp))
    for f in files:
        n = sum(1 for _ in open(f, errors="replace"))
        if n > MAX_FILE_LINES:
            problems.append(f"{rel(f)} has {n} lines (at most {MAX_FILE_LINES})")
        for name, length in long_functions(f):
            problems.append(f"{rel(f)}: {name} has {length} lines (at most {MAX_FUNCTION_LINES})")
    if not args.quiet:
        print(f"{'layer (src/ folder)':<22} files (calls out: layers they reach)")
        for k, (name, what) in enumerate(LAYERS):
            present = sorted(rel(f) for f in src_files() if layer(rel(f))[1] == name)
            print(f"{k:>2} {name + '/':<19} {what}")
            for f in present:
                reach = sorted({layer(b)[0] for a, b in file_edges if a == f and layer(b)[0] < 99})
                print(f"     {f:<28} -> {', '.join(LAYERS[r][0] for r in reach) or '-'}")
    py_problems, nmods = check_python(args.quiet)
    problems += py_problems
    for p in problems:
        print("check_layers:", p)
    if problems:
        print(f"check_layers: {len(problems)} problem(s)")
        return 1
    print(f"check_layers: {len(files)} files in {len(LAYERS)} layers (src/ folders), every call "
          f"and include goes down, no cycles; {nmods} Python modules in {len(PY_LAYERS)} layers, "
          "every import goes down or across, no cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
