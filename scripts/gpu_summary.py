"""The summary of a GPU session (scripts/gpu_session.sh), with the figure
table of bench.gpu: no torch, no gradsync (the table's module is
read from its file), so it runs after any step, even a failed build.

    python scripts/gpu_summary.py build/gpu-session     # the session's table

Reads the session directory: steps.tsv (one line per step run: name,
status, seconds, exit code; the last line of a step counts), logs/NAME.log
(pass counts: the C tests' "N passed, M failed", pytest's last line per rank,
compute-sanitizer's error summaries) and bench_np*.json (the figures).
"""
import glob
import importlib.util
import json
import os
import re
import sys


def _figures():
    """bench/gpu_figures.py, without importing gradsync."""
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "bench",
                        "gpu_figures.py")
    spec = importlib.util.spec_from_file_location("gpu_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


print_bench = _figures().print_bench

# ------------------------------------------------------------- the session

C_LINE = re.compile(r"^(test_\w+) \((\d+) ranks\): (\d+) passed, (\d+) failed", re.M)
C_SKIP = re.compile(r"^(test_\w+): .*skipped", re.M)
PYTEST_LINE = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)
RAN = re.compile(r"\b[1-9]\d* passed")
RUNS_TESTS = ("c_np1", "c_np2", "pytest_np1", "pytest_np2", "nccl_shared", "nccl_c2",
              "nccl_pytest2", "wire_nccl")
SANITIZER = re.compile(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: .*)")


def last_steps(state):
    steps = {}
    path = os.path.join(state, "steps.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    steps[parts[0]] = parts[1:]
    return steps


def counts(log):
    """What a step's log says it counted."""
    found = [f"{m[0]}@{m[1]}: {m[2]} passed, {m[3]} failed" for m in C_LINE.findall(log)]
    found += [f"{m}: skipped" for m in C_SKIP.findall(log)]
    per_rank = PYTEST_LINE.findall(log)
    if per_rank:
        same = len(set(per_rank)) == 1
        found.append(per_rank[0] + (f" (each of {len(per_rank)} ranks)" if same and
                                    len(per_rank) > 1 else "")
                     if same else " | ".join(per_rank))
    found += SANITIZER.findall(log)
    return "; ".join(found)


def summary(state, out=sys.stdout):
    steps = last_steps(state)
    info = os.path.join(state, "info.txt")
    if os.path.exists(info):
        with open(info) as f:
            text = f.read()
        gpu = re.search(r"^(NVIDIA [^,\n]+), ([\d.]+), ", text, re.M)
        nccl = re.search(r"^torch nccl (.*)$", text, re.M)
        print(f"device: {gpu.group(1) if gpu else '?'}   driver: {gpu.group(2) if gpu else '?'}"
              f"   torch's NCCL: {nccl.group(1) if nccl else '?'}", file=out)
    print(f"{'step':<12} {'status':<8} {'secs':>5}  counts", file=out)
    empty = []
    for name, (status, secs, _rc) in steps.items():
        log = os.path.join(state, "logs", name + ".log")
        text = ""
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                text = f.read()
        nothing_ran = not RAN.search(text) or C_SKIP.search(text)
        if status == "pass" and name in RUNS_TESTS and nothing_ran:
            status = "EMPTY"  # exit 0 but nothing ran: everything skipped
            empty.append(name)
        print(f"{name:<12} {status:<8} {secs:>5}  {counts(text)}", file=out)
    for path in sorted(glob.glob(os.path.join(state, "bench_np*.json"))):
        try:
            with open(path) as f:
                print_bench(json.load(f), out)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{os.path.basename(path)}: unreadable ({exc})", file=out)
    probes = os.path.join(state, "probes.json")
    if os.path.exists(probes):
        try:
            with open(probes) as f:
                found = json.load(f)
            print("\nprobe             verdict    secs  detail", file=out)
            for name, r in found.items():
                if isinstance(r, dict):
                    print(f"{name:<17} {r['verdict']:<8} {r.get('seconds', 0):>6}  "
                          f"{r['detail'][:160]}", file=out)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"probes.json: unreadable ({exc})", file=out)
    bad = [n for n, (s, _, _) in steps.items() if s != "pass"]
    bad += [n for n in empty if n not in bad]
    print(f"\nsteps not passed: {' '.join(bad) if bad else 'none'}", file=out)
    return bad


def main(argv):
    """summary [STATE] [--expect-pass A,B,...]: exit 1 if a step named there
    did not pass (make test's dry run of the session uses it)."""
    expect = []
    if "--expect-pass" in argv:
        i = argv.index("--expect-pass")
        expect = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    state = argv[0] if argv else "build/gpu-session"
    bad = summary(state)
    steps = last_steps(state)
    missing = [n for n in expect if n in bad or n not in steps]
    if missing:
        print(f"expected to pass: {' '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
