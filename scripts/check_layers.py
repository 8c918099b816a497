#!/usr/bin/env python3
"""Checks src/'s layering from the compiler's own call graph.

Every C file of src/ is compiled with gcc's -fcallgraph-info (the .cu file's
host side with g++ over the same flags, its kernels being leaves), which
lists each function a file defines and each function it calls. Each file
belongs to one layer of LAYERS below (bottom first). The check fails when
- a call goes up: a function in one layer calls one defined in a higher one;
- files call each other in a cycle (within a layer too);
- a private header includes one of a higher layer, or headers include each
  other in a cycle;
- a C file is longer than MAX_FILE_LINES, or a function than MAX_FUNCTION_LINES;
- a file of src/ is in no layer.
Calls through function pointers (the transport table, queued jobs) are not
calls in this graph: they are how a lower layer runs what a higher one gave
it. The layer table is printed with each file's outgoing calls by layer.

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

# (layer, what it is, its files) from the bottom up. A file calls its own
# layer or lower ones; headers likewise include their own layer or lower.
LAYERS = [
    ("base", "status and last error, logging, every environment knob, dtypes, the clock, "
     "hashes, the timeline recorder",
     ["gs_base.h", "status.c", "log.c", "env.c", "dtype.c", "clock.c", "timeline.c",
      "half.h"]),
    ("kernels", "host kernels; CUDA kernels and their launchers (pure computation)",
     ["gs_kernels_internal.h", "simd.h", "cpu_simd.c", "cpu_kernels.c", "cpu_reduce.c",
      "cpu_scale.c", "cpu_adasum.c", "cuda_pieces.cuh", "cuda_kernels.cu"]),
    ("runtime", "the runtime lock, a communicator's fate, the one wait loop",
     ["gs_runtime.h", "runtime.c", "progress.c"]),
    ("device", "CUDA contexts, streams, events, memory, kernel tables, the kernels on "
     "CUDA memory",
     ["gs_cuda.h", "cuda_device.c", "cuda_memory.c", "cuda_ring.c", "device_memory.c", "cuda_jobs.c",
      "cuda_absent.c", "device_kernels.c"]),
    ("mpi", "the communicator's state, MPI types and ops, the MPI wait, recursive doubling",
     ["gs_comm_state.h", "gs_mpi.h", "mpi_types.c", "mpi_wait.c", "rdouble.c"]),
    ("transports", "one gs_transport_t per way of moving data; hosts and the hierarchical "
     "allreduce; MPI's exchange collectives",
     ["gs_transport.h", "transport_mpi.c", "transport_cuda_aware.c", "transport_staged.c",
      "transport_nccl.c", "hierarchical.c", "mpi_xfer.c"]),
    ("engine", "where a call's data lives and which path moves it, its buffers, the fusion "
     "plan, pack and unpack",
     ["gs_engine.h", "engine.c", "buffers.c", "fusion.c"]),
    ("queue", "the background thread, requests, entering the runtime",
     ["gs_queue.h", "queue.c"]),
    ("algorithms", "Adasum, and the exchange collectives' data movement, over the "
     "transport and kernel entries",
     ["gs_algorithms.h", "adasum.c", "xfer.c"]),
    ("communicator", "communicators, argument checks, cross-rank validation",
     ["gs_comm_internal.h", "comm.c", "args.c", "check.c", "check_explain.c",
      "check_stall.c"]),
    ("collectives", "the call skeleton and the public collectives, kernels and info",
     ["gs_collective.h", "collective.c", "allreduce.c", "broadcast.c", "allgather.c",
      "reduce_scatter.c", "shard.c", "alltoall.c", "rooted.c", "reduce.c", "p2p.c",
      "kernels.c", "info.c"]),
    ("async", "the asynchronous entry points, over the queue",
     ["async.c"]),
]

DEF = re.compile(r'node: \{ title: "([^"]+)" label: "([^"\\]+)\\n([^:]+):(\d+)')
EDGE = re.compile(r'edge: \{ sourcename: "([^"]+)" targetname: "([^"]+)"')


def layer_of():
    table = {}
    for k, (name, _, files) in enumerate(LAYERS):
        for f in files:
            table[f] = (k, name)
    return table


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
            out = os.path.join(tmp, os.path.basename(f) + ".o")
            cmd = compiler + flags + ["-fcallgraph-info", "-c", f, "-o", out]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if r.returncode != 0:
                if f.endswith(".cu"):  # kernels need nvcc: no host-side edges to read
                    continue
                raise SystemExit(f"check_layers: cannot compile {f}:\n{r.stderr}")
            ci = out[:-2] + ".ci"
            text = open(ci).read() if os.path.exists(ci) else ""
            base = os.path.basename(f)
            for title, _, where, _ in DEF.findall(text):
                if os.path.basename(where) == base and "shape" not in title:
                    defined.setdefault(title.split(":")[-1], base)
                    local.add((base, title.split(":")[-1]))
            for src, dst in EDGE.findall(text):
                edges.append((base, dst.split(":")[-1], src.split(":")[-1]))
    return defined, local, edges


def shlex_split(s):
    import shlex
    return shlex.split(s)


def includes():
    """[(file, included private header)] for src/ files and headers."""
    out = []
    for f in sorted(glob.glob(os.path.join(SRC, "*"))):
        for line in open(f, errors="replace"):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m and os.path.exists(os.path.join(SRC, m.group(1))):
                out.append((os.path.basename(f), m.group(1)))
    return out


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
    layers = layer_of()
    files = sorted(glob.glob(os.path.join(SRC, "*.c")) + glob.glob(os.path.join(SRC, "*.cu")))
    problems = []
    for f in sorted(os.listdir(SRC)):
        if f not in layers:
            problems.append(f"{f} is in no layer (add it to LAYERS in scripts/check_layers.py)")
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
        lc, lt = layers.get(caller, (99, "?")), layers.get(target, (99, "?"))
        if lt[0] > lc[0]:
            up.setdefault((caller, target), set()).add(f"{fn} -> {callee}")
    for (a, b), calls in sorted(up.items()):
        problems.append(f"call up: {a} ({layers.get(a, (0, '?'))[1]}) calls {b} "
                        f"({layers.get(b, (0, '?'))[1]}): "
                        + ", ".join(sorted(calls)[:4]))
    for comp in cycles(file_edges):
        problems.append("call cycle among " + ", ".join(comp))
    inc = includes()
    for a, b in inc:
        if a in layers and b in layers and layers[b][0] > layers[a][0]:
            problems.append(f"include up: {a} ({layers[a][1]}) includes {b} ({layers[b][1]})")
    for comp in cycles(inc):
        problems.append("include cycle among " + ", ".join(comp))
    for f in files:
        n = sum(1 for _ in open(f, errors="replace"))
        if n > MAX_FILE_LINES:
            problems.append(f"{os.path.basename(f)} has {n} lines (at most {MAX_FILE_LINES})")
        for name, length in long_functions(f):
            problems.append(f"{os.path.basename(f)}: {name} has {length} lines "
                            f"(at most {MAX_FUNCTION_LINES})")
    if not args.quiet:
        print(f"{'layer':<14} files (calls out: layers they reach)")
        for k, (name, what, fs) in enumerate(LAYERS):
            present = [f for f in fs if os.path.exists(os.path.join(SRC, f))]
            print(f"{k:>2} {name:<11} {what}")
            for f in present:
                reach = sorted({layers[b][0] for a, b in file_edges if a == f and b in layers})
                print(f"     {f:<24} -> {', '.join(LAYERS[r][0] for r in reach) or '-'}")
    for p in problems:
        print("check_layers:", p)
    if problems:
        print(f"check_layers: {len(problems)} problem(s)")
        return 1
    print(f"check_layers: {len(files)} files in {len(LAYERS)} layers, every call and include "
          "goes down, no cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
