#!/usr/bin/env python3
"""Runs Horovod's own PyTorch tests against gradsync.horovod on the CPU.

Horovod's tests are not in its PyPI sdist (and are not part of this
project): give this script a Horovod checkout, a work tree or a bare git
directory, and it exports the three files it runs into a temporary folder::

    python3 scripts/horovod_conformance.py --horovod ~/src/horovod \\
        --ranks 1,2,3,4 --mode both --json /tmp/conformance.json

- test/parallel/test_torch.py, test_adasum_pytorch.py, test_timeline.py
  (and test/utils/common.py, which they import) are exported from the
  checkout (``git show REV:path`` for a git directory);
- ``import horovod.torch as hvd`` resolves to gradsync.horovod.torch through
  the opt-in alias (``python -m gradsync.horovod.alias`` is put on
  PYTHONPATH); ``mock``, which common.py imports, is provided from
  unittest.mock when it is not installed;
- ``--mode per-test``: each test in its own ``mpiexec -n N`` job, one plain
  pytest per rank, with a per-test timeout; a job that outlives it is a hang;
- ``--mode file``: each file as Horovod's CI runs it, ``mpiexec -n N python
  -m pytest FILE`` (one pytest per rank, no mpi4py wrapper); a job that
  outlives its timeout is a hang of the test it was in, and the tests after
  it are counted as not run.

Jobs run with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=60 (``--stall-shutdown``;
0 leaves it unset), Horovod's own knob for "shut every rank down when an
operation waits that long for ranks that never submit it": after a test fails
on some ranks only, the ranks' operations no longer pair up, and Horovod, like
gradsync.horovod, would otherwise wait forever.

A test passes when no rank failed and some rank passed, is skipped when
every rank skipped it, and fails otherwise. The table (and ``--json``) gives
passed/failed/hung/skipped per file and rank count, with the names of the
tests that did not pass and the first line of their failure.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ("test/parallel/test_torch.py", "test/parallel/test_adasum_pytorch.py",
         "test/parallel/test_timeline.py")
SUPPORT = ("test/utils/common.py",)

# A pytest plugin (on PYTHONPATH of the jobs) that writes every rank's
# outcomes, one JSON line per event, flushed as they happen, so that a job
# killed by its timeout still says which test it was in.
PLUGIN = r'''
import json, os

_out = None


def _write(**record):
    global _out
    if _out is None:
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        path = os.path.join(os.environ["GS_HVD_REPORT_DIR"], "rank-%s.jsonl" % rank)
        _out = open(path, "a")
    _out.write(json.dumps(record) + "\n")
    _out.flush()


def pytest_runtest_logstart(nodeid, location):
    _write(event="start", test=nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.when == "teardown" and report.outcome == "passed":
            return
        text = ""
        if report.outcome == "failed":
            text = str(report.longrepr).strip().splitlines()
            text = next((l for l in reversed(text) if l.startswith("E ")), text[-1] if text else "")
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            text = str(report.longrepr[2])
        _write(event="outcome", test=report.nodeid, when=report.when,
               outcome=report.outcome, text=text[:300])
'''


def common_arguments(p, prefix):
    """The arguments every Horovod-checkout script here takes (this one and
    horovod_examples.py); ``prefix`` names its temporary folder."""
    p.add_argument("--horovod", required=True,
                   help="a Horovod checkout: work tree or git directory")
    p.add_argument("--rev", default="HEAD", help="revision, for a git directory")
    p.add_argument("--pythonpath", default=os.path.join(HERE, "..", "pyx"),
                   help="where gradsync is (default: this checkout's pyx)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"))
    p.add_argument("--keep", help="export into this folder and keep it")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(folder_prefix=prefix)


def prepare(args, paths):
    """(folder, environment): ``paths`` of the checkout exported into a
    temporary folder (or --keep), and the jobs' environment, in which
    ``import horovod`` is gradsync's opt-in alias (first on PYTHONPATH)."""
    root = args.keep or tempfile.mkdtemp(prefix=args.folder_prefix)
    export(os.path.abspath(args.horovod), args.rev, root, paths)
    pypath = os.path.abspath(args.pythonpath)
    alias = os.path.join(pypath, "gradsync", "horovod", "alias")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [alias, pypath] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return root, env


def export(horovod, rev, dest, paths=FILES + SUPPORT):
    """Files of a Horovod work tree or git directory (by default the ones
    this script runs), copied under dest at their paths."""
    is_git_dir = os.path.exists(os.path.join(horovod, "HEAD")) and \
        os.path.isdir(os.path.join(horovod, "objects"))
    for path in paths:
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if is_git_dir:
            data = subprocess.run(["git", f"--git-dir={horovod}", "show", f"{rev}:{path}"],
                                  check=True, capture_output=True).stdout
            with open(target, "wb") as f:
                f.write(data)
        else:
            shutil.copyfile(os.path.join(horovod, path), target)


def shims(dest):
    """The report plugin, and mock when it is not installed."""
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "gs_hvd_report.py"), "w") as f:
        f.write(PLUGIN)
    try:
        import mock  # noqa: F401
    except ImportError:
        with open(os.path.join(dest, "mock.py"), "w") as f:
            f.write('"""mock, for Horovod\'s test utilities: unittest.mock."""\n'
                    "from unittest.mock import *  # noqa: F401,F403\n")


def collect(python, env, path, cwd):
    """The test ids of one file, as pytest collects them (one process)."""
    out = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", path], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=300)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected from {path}:\n{out.stdout}\n{out.stderr}")
    return ids


def read_reports(folder):
    """{rank: [records]} from the plugin's files."""
    reports = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank-"):
            with open(os.path.join(folder, name)) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            reports[int(name[5:-6])] = recs
    return reports


def verdict(outcomes):
    """One test's verdict from its per-rank outcomes (lists of records)."""
    seen = [o for recs in outcomes for o in recs]
    if any(o["outcome"] == "failed" for o in seen):
        first = next(o for o in seen if o["outcome"] == "failed")
        return "failed", first["text"]
    if seen and all(o["outcome"] == "skipped" for o in seen):
        return "skipped", seen[0]["text"]
    if any(o["outcome"] == "passed" for o in seen):
        return "passed", ""
    return "failed", "no outcome reported"


def run_job(cmd, env, cwd, timeout):
    """Runs an mpiexec job in its own process group; (rc, timed_out, tail)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        timed_out = True
    return proc.returncode, timed_out, out.decode(errors="replace")[-3000:], \
        time.monotonic() - start


def per_test(args, env, root, path, ranks):
    results = {}
    for test in collect(args.python, env, path, root):
        if args.k and not any(k in test for k in args.k):
            continue
        report = tempfile.mkdtemp(prefix="gs-hvd-report-")
        cmd = [args.mpiexec, "-n", str(ranks), args.python, "-m", "pytest", "-q", "-p",
               "no:cacheprovider", "-p", "gs_hvd_report", test]
        rc, hung, tail, secs = run_job(cmd, dict(env, GS_HVD_REPORT_DIR=report), root,
                                       args.timeout)
        reports = read_reports(report)
        shutil.rmtree(report, ignore_errors=True)
        if hung:
            results[test] = ("hung", f"no result within {args.timeout} s")
        else:
            recs = [[r for r in reports.get(k, []) if r["event"] == "outcome"]
                    for k in range(ranks)]
            results[test] = verdict(recs)
            if results[test] == ("failed", "no outcome reported"):
                results[test] = ("failed", f"exit {rc}: {tail.strip().splitlines()[-1:]}")
        if args.verbose:
            print(f"  {ranks} ranks {results[test][0]:8s} {secs:6.1f}s {test}", flush=True)
    return results


def whole_file(args, env, root, path, ranks):
    tests = collect(args.python, env, path, root)
    report = tempfile.mkdtemp(prefix="gs-hvd-report-")
    cmd = [args.mpiexec, "-n", str(ranks), args.python, "-m", "pytest", "-q", "-p",
           "no:cacheprovider", "-p", "gs_hvd_report", path]
    rc, hung, tail, secs = run_job(cmd, dict(env, GS_HVD_REPORT_DIR=report), root,
                                   args.file_timeout)
    reports = read_reports(report)
    shutil.rmtree(report, ignore_errors=True)
    results = {}
    hang_named = False  # one hang per job: the first test some rank never finished
    for test in tests:
        recs = [[r for r in reports.get(k, []) if r["event"] == "outcome" and r["test"] == test]
                for k in range(ranks)]
        started = any(r["event"] == "start" and r["test"] == test
                      for k in range(ranks) for r in reports.get(k, []))
        if any(recs) and all(recs):
            results[test] = verdict(recs)
        elif hung and started and not hang_named:
            hang_named = True
            results[test] = ("hung", f"the job was in this test when its {args.file_timeout} s "
                                     "ran out")
        elif hung:
            results[test] = ("not run", "after the hang")
        elif started:
            results[test] = ("failed", f"not finished on every rank (job exit {rc})")
        else:
            results[test] = ("not run", "the job ended before this test")
    if args.verbose:
        print(f"  whole file at {ranks} ranks: exit {rc}, {secs:.0f} s"
              f"{' (timed out)' if hung else ''}", flush=True)
    return results


def summary(results):
    counts = {}
    for outcome, _ in results.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(p, "gs-hvd-conformance-")
    p.add_argument("--ranks", default="1,2,3,4")
    p.add_argument("--mode", choices=("per-test", "file", "both"), default="both")
    p.add_argument("--files", default=",".join(os.path.basename(f) for f in FILES))
    p.add_argument("-k", action="append", help="only tests whose id contains this")
    p.add_argument("--timeout", type=float, default=120, help="seconds per test job")
    p.add_argument("--file-timeout", type=float, default=1200, help="seconds per file job")
    p.add_argument("--stall-shutdown", type=float, default=60,
                   help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS for the jobs (0: unset)")
    p.add_argument("--json", help="write every test's outcome here")
    args = p.parse_args(argv)

    root, env = prepare(args, FILES + SUPPORT)
    shim_dir = os.path.join(root, "gs_shims")
    shims(shim_dir)
    env["PYTHONPATH"] += os.pathsep + shim_dir
    if args.stall_shutdown:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_shutdown)

    table = {}
    try:
        for name in args.files.split(","):
            path = os.path.join("test", "parallel", name)
            for ranks in [int(r) for r in args.ranks.split(",")]:
                modes = ("per-test", "file") if args.mode == "both" else (args.mode,)
                for mode in modes:
                    fn = per_test if mode == "per-test" else whole_file
                    results = fn(args, env, root, path, ranks)
                    table[f"{name} {mode} {ranks}"] = results
                    counts = summary(results)
                    print(f"{name:24s} {mode:8s} {ranks} ranks: " + ", ".join(
                        f"{counts.get(k, 0)} {k}" for k in
                        ("passed", "failed", "hung", "skipped", "not run") if counts.get(k)),
                        flush=True)
                    for test, (outcome, text) in sorted(results.items()):
                        if outcome in ("failed", "hung"):
                            print(f"    {outcome:6s} {test.split('::')[-1]}: {text}",
                                  flush=True)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({k: {t: list(v) for t, v in r.items()} for k, r in table.items()},
                          f, indent=1)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
