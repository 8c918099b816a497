"""The summary of a GPU session (scripts/gpu_session.sh) and the figure table
of scripts/bench_gpu.py: no torch, no gradsync, so it runs after any step.

    python scripts/gpu_summary.py build/gpu-session     # the session's table

Reads the session directory: steps.tsv (one line per step run: name,
status, seconds, exit code; the last line of a step counts), logs/NAME.log
(pass counts: the C tests' "N passed, M failed", pytest's last line per rank,
compute-sanitizer's error summaries) and bench_np*.json (the figures).
"""
import glob
import json
import os
import re
import sys

# ------------------------------------------------------------- the figures


def figure_rows(r):
    """(what, value, goal, check) for every figure in one bench_gpu.py result."""
    rows = []
    a = r.get("accumulate") or {}
    if "fraction_of_copy" in a:
        n = a.get("elements", 0)
        size = f"{n / 2**20:.0f}M" if n >= 2**20 else str(n)
        rows += [(f"(a) accumulate_ f32+=bf16 {size}, fraction of D2D copy bandwidth",
                  a["fraction_of_copy"], ">= 0.85", a["check"]),
                 ("(a) accumulate_ speed-up vs torch acc.add_(grad.float())",
                  a["speedup_vs_torch_add_cast"], "> 1", a["check"]),
                 ("(a) accumulate_ speed-up vs torch acc.add_(grad) (mixed dtype)",
                  a["speedup_vs_torch_add_mixed"], "(info)", a["check"])]
    b = r.get("bert") or {}
    for label in ("f32+=f32", "f32+=bf16"):
        if label in b:
            rows += [(f"(b) BERT-base 199 tensors {label}: speed-up vs Python add_ loop",
                      b[label]["speedup_vs_loop"], "(report)", b[label]["check"]),
                     (f"(b) BERT-base 199 tensors {label}: speed-up vs _foreach_add_",
                      b[label]["speedup_vs_foreach"], "(info)", b[label]["check"])]
    c = r.get("allreduce") or {}
    if "ratio_vs_per_tensor" in c:
        rows += [(f"(c) ResNet-50 allreduce ({c['device_transport']}), time / torch per-tensor",
                  c["ratio_vs_per_tensor"], "<= 1.05", c["check"]),
                 ("(c) ResNet-50 allreduce, time / torch flatten+1 call+unflatten",
                  c["ratio_vs_pack_unpack"], "(info)", c["check"]),
                 ("(c) ResNet-50 allreduce, time / torch 1 call on flat data",
                  c["ratio_vs_flat"], "(info)", c["check"])]
    d = r.get("train") or {}
    if "modes" in d:
        m = d["modes"]
        nan = float("nan")
        rows += [("(d) ResNet-50 step: gradsync / DDP-gloo", d["gradsync_vs_ddp_gloo"], "< 1", ""),
                 ("(d) ResNet-50 step: gradsync / compute only", m["gradsync"]["vs_compute"],
                  "(report)", ""),
                 ("(d) ResNet-50 step: DDP-gloo / compute only", m["ddp-gloo"]["vs_compute"],
                  "(report)", ""),
                 ("(d) share of comm hidden (compute+comm-step)/comm, gradsync",
                  _num(m["gradsync"]["share_of_comm_hidden"], nan), "(report)", ""),
                 ("(d) share of comm hidden (compute+comm-step)/comm, DDP-gloo",
                  _num(m["ddp-gloo"]["share_of_comm_hidden"], nan), "(report)", "")]
    return rows


def _num(v, default):
    return default if v is None else v


def print_bench(r, out=sys.stdout):
    """The figure table, then the training and trace tables."""
    env = r.get("environment", {})
    print(f"\n== bench_gpu: {env.get('gpu', env.get('device'))}, {env.get('ranks')} rank(s), "
          f"torch {env.get('torch')}, gradsync NCCL {env.get('gradsync', {}).get('nccl')}"
          + (" (DRY RUN: the figures mean nothing)" if r.get("dry_run") else ""), file=out)
    rows = figure_rows(r)
    if rows:
        print(f"{'figure':<70} {'value':>8}  {'goal':<9} check", file=out)
    for what, v, goal, check in rows:
        print(f"{what:<70} {v:8.3f}  {goal:<9} {check}", file=out)
    for k in ("accumulate", "bert", "allreduce", "train"):
        v = r.get(k)
        if isinstance(v, dict) and ("error" in v or "skipped" in v):
            print(f"{k}: {v.get('error') or 'skipped: ' + v['skipped']}", file=out)
    d = r.get("train") or {}
    if "modes" in d:
        print_train(d, out)


TRACE_KEYS = ("backward_span_ms", "backward_busy_ms", "comm_busy_ms", "comm_in_backward_ms",
              "comm_overlap_share", "comm_overlaps_kernels_ms", "comm_lead_ms", "comm_tail_ms")


def print_train(d, out=sys.stdout):
    print(f"\n(d) training step, {d['ranks']} ranks ({d['device_transport']}), ResNet width "
          f"{d['width']} ({d['parameters']:,} parameters), batch {d['batch_per_rank']} x "
          f"{d['image']}^2 per rank; median of {d['timed_rounds']} rounds, slowest rank:",
          file=out)
    for name, m in d["modes"].items():
        print(f"  {name:<9} {1e3 * m['median_s']:9.1f} ms   {m['what']}", file=out)
    print(f"  replicas identical: {d['replicas_identical']}; gradsync vs DDP parameters after "
          f"the run: max relative difference {d['gradsync_vs_ddp_params_max_rel_diff']:.2e}",
          file=out)
    t = d.get("trace")
    if not t:
        return
    print("\n(d) trace on rank 0 (torch.profiler), median over the profiled steps; ms unless "
          "a share:", file=out)
    heads = [k[:-3] if k.endswith("_ms") else k for k in TRACE_KEYS]
    print(f"  {'mode':<9} " + " ".join(f"{h:>24}" for h in heads), file=out)
    for name, s in t.items():
        cells = [f"{'n/a':>24}" if s.get(k) is None else f"{s[k]:24.2f}" for k in TRACE_KEYS]
        print(f"  {name:<9} " + " ".join(cells), file=out)


# ------------------------------------------------------------- the session

C_LINE = re.compile(r"^(test_\w+) \((\d+) ranks\): (\d+) passed, (\d+) failed", re.M)
C_SKIP = re.compile(r"^(test_\w+): .*skipped", re.M)
PYTEST_LINE = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)
RAN = re.compile(r"\b[1-9]\d* passed")
RUNS_TESTS = ("c_np1", "c_np2", "pytest_np1", "pytest_np2")
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
    bad = [n for n, (s, _, _) in steps.items() if s != "pass"]
    bad += [n for n in empty if n not in bad]
    print(f"\nsteps not passed: {' '.join(bad) if bad else 'none'}", file=out)


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else "build/gpu-session")
