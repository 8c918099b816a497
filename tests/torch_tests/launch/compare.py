"""Compares two report files of torch's suite (dist_suite.py's or the
mpiexec adapter's GS_TORCH_UPSTREAM_REPORT: `status name: reason` lines),
gloo's and gradsync's, test by test: `make torch-upstream-spawn`.

``python compare.py GLOO_REPORT GRADSYNC_REPORT`` prints both backends'
counts and every test gloo passes that gradsync does not, with torch's
reason; exits 1 when a test failed on gradsync, or when gloo passes a test
that gradsync skips for a reason that names no backend (torch gates tests
to gloo, NCCL or its MPI backend by name: those are expected)."""
import re
import sys
from collections import Counter

NAMES_A_BACKEND = re.compile(r"backend|gloo|nccl|mpi", re.IGNORECASE)


def read(path):
    outcomes = {}
    with open(path) as f:
        for line in f:
            status, rest = line.rstrip("\n").split(" ", 1)
            name, _, reason = rest.partition(": ")
            outcomes[name] = (status, reason)
    return outcomes


def compare(gloo, ours):
    """(lines to print, whether gradsync holds up against gloo)."""
    count = {k: Counter(s for s, _ in v.values()) for k, v in (("gloo", gloo), ("gradsync", ours))}
    lines = [f"{k}: " + ", ".join(f"{c[s]} {s}" for s in ("pass", "skip", "fail"))
             for k, c in count.items()]
    bad = [f"fail {n}: {r}" for n, (s, r) in sorted(ours.items()) if s == "fail"]
    for name, (status, _) in sorted(gloo.items()):
        got, why = ours.get(name, ("missing", ""))
        if status == "pass" and got != "pass":
            gated = got == "skip" and NAMES_A_BACKEND.search(why)
            (lines if gated else bad).append(f"gloo passes, gradsync {got}s {name}: {why}")
    return lines + bad, not bad


if __name__ == "__main__":
    out, ok = compare(read(sys.argv[1]), read(sys.argv[2]))
    print("\n".join(out))
    sys.exit(0 if ok else 1)
