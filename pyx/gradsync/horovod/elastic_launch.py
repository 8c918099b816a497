"""gradsyncrun's elastic mode: ``gradsyncrun -np N --min-np M [--max-np K]
[--replacements R] python train.py`` (docs/GUIDE.md section 2.16).

mpiexec's launcher ends every rank when one dies. Here gradsyncrun starts
the N processes itself, on this host, as MPI singletons that join one world
through a folder store it makes (RANK, WORLD_SIZE, LOCAL_RANK,
GRADSYNC_STORE_DIR): a process that dies is reported and the others go on
(gradsync.elastic shrinks their world), as long as at least M are running.
After a loss it starts up to R replacements (GRADSYNC_JOIN_RUNNING=1: they
join the running world at the members' next commit), never more than K
running at once. It returns 0 when at least M processes ended with status
0, else 1; SIGINT and SIGTERM reach every process. The store's folder is
removed at the end.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# what an MPI launcher sets: a process that sees them is not a singleton
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCAL")
_POLL_SECONDS = 0.05


def check(args):
    """SystemExit naming what is wrong with the elastic flags."""
    n = args.num_proc
    min_np = n if args.min_np is None else args.min_np
    max_np = n if args.max_np is None else args.max_np
    if not 1 <= min_np <= n <= max_np:
        raise SystemExit(f"gradsyncrun: need 1 <= --min-np ({min_np}) <= -np ({n}) <= --max-np "
                         f"({max_np})")
    if args.replacements < 0:
        raise SystemExit(f"gradsyncrun: --replacements must be >= 0, got {args.replacements}")
    if args.hosts or args.hostfile:
        raise SystemExit("gradsyncrun: --min-np/--max-np start the processes on this host only "
                         "(-H/--hostfile: use mpiexec's mode, without --min-np)")
    if not args.command:
        raise SystemExit("gradsyncrun: no command to run (e.g. gradsyncrun -np 4 --min-np 3 "
                         "python train.py)")
    return min_np, max_np


class _Job:
    def __init__(self, command, env):
        self.command, self.env = command, env
        self.procs = []      # (label, Popen)
        self.ended = {}      # label -> status

    def start(self, label, extra):
        env = dict(self.env, **extra)
        self.procs.append((label, subprocess.Popen(self.command, env=env)))

    def running(self):
        return [(label, p) for label, p in self.procs if p.poll() is None]

    def newly_ended(self):
        out = []
        for label, p in self.procs:
            if p.poll() is not None and label not in self.ended:
                self.ended[label] = p.returncode
                out.append((label, p.returncode))
        return out

    def signal_all(self, sig):
        for _label, p in self.running():
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _status(rc):
    return f"signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else f"status {rc}"


def launch(args, extra_env):
    """Runs the job; returns gradsyncrun's exit status."""
    min_np, max_np = check(args)
    store = tempfile.mkdtemp(prefix="gradsyncrun-store-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(extra_env, GRADSYNC_STORE_DIR=store)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GRADSYNC_JOIN_RUNNING"):
        env.pop(var, None)
    job = _Job(list(args.command), env)
    n = args.num_proc
    stop = []

    def forward(sig, _frame):
        stop.append(sig)
        job.signal_all(sig)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for r in range(n):
            job.start(f"rank {r}", {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                                    "LOCAL_WORLD_SIZE": str(n)})
        replaced = 0
        while job.running():
            time.sleep(_POLL_SECONDS)
            for label, rc in job.newly_ended():
                if rc == 0:
                    continue
                print(f"gradsyncrun: {label} ended with {_status(rc)}; "
                      f"{len(job.running())} still running", file=sys.stderr, flush=True)
                if stop:
                    continue
                if len(job.running()) < min_np:
                    print(f"gradsyncrun: fewer than --min-np {min_np} running: stopping the job",
                          file=sys.stderr, flush=True)
                    job.signal_all(signal.SIGTERM)
                    stop.append(signal.SIGTERM)
                elif replaced < args.replacements and len(job.running()) < max_np and \
                        0 not in job.ended.values():  # not once the job is finishing
                    replaced += 1
                    job.start(f"replacement {replaced}", {"GRADSYNC_JOIN_RUNNING": "1"})
        job.newly_ended()
        finished = sum(1 for rc in job.ended.values() if rc == 0)
        return 0 if finished >= min_np and not stop else 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(store, ignore_errors=True)
