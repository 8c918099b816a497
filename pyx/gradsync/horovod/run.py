"""gradsyncrun: horovodrun's command line, run as the mpiexec command it
stands for (gradsync launches nothing itself)::

    gradsyncrun -np 4 -H host1:2,host2:2 python train.py
    # MPICH:    mpiexec -n 4 -hosts host1:2,host2:2 python train.py
    # Open MPI: mpiexec -n 4 -H host1:2,host2:2 python train.py

Horovod's tuning flags become the HOROVOD_* variables gradsync.horovod reads
at init(), passed to every rank (-genv / -x). ``--dry-run`` prints the
command instead of running it. With ``--min-np``/``--max-np`` it launches
the processes itself instead (elastic_launch.py: a lost rank does not end
the job).
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from gradsync.horovod import elastic_launch

# horovodrun flag -> (HOROVOD_* variable, how its value is written)
_ENV_FLAGS = {
    "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", lambda v: str(int(float(v) * 2**20))),
    "cycle_time_ms": ("HOROVOD_CYCLE_TIME", str),
    "cache_capacity": ("HOROVOD_CACHE_CAPACITY", str),
    "timeline_filename": ("HOROVOD_TIMELINE", str),
    "stall_check_warning_time_seconds": ("HOROVOD_STALL_CHECK_TIME_SECONDS", str),
    "stall_check_shutdown_time_seconds": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str),
    "log_level": ("HOROVOD_LOG_LEVEL", str),
}


def parser():
    p = argparse.ArgumentParser(
        prog="gradsyncrun",
        description="Run a Horovod-style training script under mpiexec (horovodrun's "
                    "arguments; gradsync.horovod reads the HOROVOD_* settings).")
    p.add_argument("-np", "--num-proc", type=int, required=True, help="number of processes")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots (default: this host)")
    p.add_argument("-hostfile", "--hostfile", help="lines 'hostname slots=N' (horovodrun's format)")
    p.add_argument("-p", "--ssh-port", type=int,
                   help="accepted; configure ssh for your MPI launcher instead")
    p.add_argument("--fusion-threshold-mb", type=float)
    p.add_argument("--cycle-time-ms", type=float, help="accepted; gradsync has no cycle")
    p.add_argument("--cache-capacity", type=int, help="accepted; gradsync has no response cache")
    p.add_argument("--timeline-filename")
    p.add_argument("--timeline-mark-cycles", action="store_true", help="accepted; no cycles")
    p.add_argument("--no-stall-check", action="store_true")
    p.add_argument("--stall-check-warning-time-seconds", type=float)
    p.add_argument("--stall-check-shutdown-time-seconds", type=float)
    p.add_argument("--log-level")
    p.add_argument("--min-np", type=int, help="elastic: keep the job running while at least "
                   "this many processes do (this host; gradsync.elastic shrinks the world)")
    p.add_argument("--max-np", type=int, help="elastic: never more than this many running")
    p.add_argument("--replacements", type=int, default=0,
                   help="elastic: start up to this many processes in place of lost ones (they "
                   "join the running world at its next commit)")
    p.add_argument("--mpi-args", default="", help="more arguments for mpiexec")
    p.add_argument("--mpi", action="store_true", help="accepted (gradsync always runs on MPI)")
    p.add_argument("--gloo", action="store_true", help="refused: gradsync runs on MPI")
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC"),
                   help="the launcher (default: $MPIEXEC, mpiexec on PATH, or the mpich wheel's)")
    p.add_argument("--verbose", action="store_true", help="print the command before running it")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def find_mpiexec():
    found = shutil.which("mpiexec")
    if found:
        return found
    wheel = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    return wheel if os.path.exists(wheel) else "mpiexec"


def flavour(mpiexec):
    """'openmpi' or 'mpich' (Hydra, and the default for anything else)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "mpich"
    return "openmpi" if ("Open MPI" in out or "OpenRTE" in out or "PRRTE" in out) else "mpich"


def _hostfile_for_mpich(path):
    """horovodrun's 'host slots=N' lines as Hydra's 'host:N' lines."""
    lines = []
    with open(path) as f:
        for line in f:
            fields = line.split("#")[0].split()
            if not fields:
                continue
            slots = next((x.split("=", 1)[1] for x in fields[1:] if x.startswith("slots=")), None)
            lines.append(fields[0] + (f":{slots}" if slots else ""))
    tmp = tempfile.NamedTemporaryFile("w", prefix="gradsyncrun-", suffix=".hosts", delete=False)
    tmp.write("\n".join(lines) + "\n")
    tmp.close()
    return tmp.name


def environment(args):
    env = {}
    for flag, (name, fmt) in _ENV_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            env[name] = fmt(value)
    if args.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    return env


def command(args, kind):
    """The mpiexec command line for parsed arguments and an MPI flavour."""
    if args.gloo:
        raise SystemExit("gradsyncrun: --gloo: gradsync runs on MPI only")
    if not args.command:
        raise SystemExit("gradsyncrun: no command to run (e.g. gradsyncrun -np 2 python train.py)")
    cmd = [args.mpiexec or find_mpiexec(), "-n", str(args.num_proc)]
    if args.hosts:
        cmd += ["-hosts" if kind == "mpich" else "-H", args.hosts]
    if args.hostfile:
        cmd += (["-f", _hostfile_for_mpich(args.hostfile)] if kind == "mpich"
                else ["--hostfile", args.hostfile])
    for name, value in sorted(environment(args).items()):
        cmd += ["-genv", name, value] if kind == "mpich" else ["-x", f"{name}={value}"]
    cmd += shlex.split(args.mpi_args)
    return cmd + list(args.command)


def main(argv=None):
    args = parser().parse_args(argv)
    if args.min_np is not None or args.max_np is not None:  # elastic: no mpiexec
        if args.verbose or args.dry_run:
            print(f"gradsyncrun: elastic, {args.num_proc} singleton processes on this host "
                  f"joined through a folder store: {shlex.join(args.command)}", flush=True)
        return 0 if args.dry_run else elastic_launch.launch(args, environment(args))
    mpiexec = args.mpiexec or find_mpiexec()
    args.mpiexec = mpiexec
    cmd = command(args, flavour(mpiexec))
    if args.verbose or args.dry_run:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ, **environment(args))
    try:
        return subprocess.call(cmd, env=env)
    finally:  # the translated hostfile Hydra read (MPICH), ours to remove
        if "-f" in cmd and os.path.basename(cmd[cmd.index("-f") + 1]).startswith("gradsyncrun-"):
            os.unlink(cmd[cmd.index("-f") + 1])


if __name__ == "__main__":
    sys.exit(main())


# ---- horovod.run(): a function on N processes ------------------------------------

def _pickler():
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        import pickle

        return pickle


def run(func, args=(), kwargs=None, np=1, min_np=None, max_np=None, slots=None,
        reset_limit=None, hosts=None, hostfile=None, start_timeout=None, ssh_port=None,
        ssh_identity_file=None, disable_cache=None, output_filename=None, verbose=None,
        use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None, executable=None):
    """Horovod's ``horovod.run``: calls ``func(*args, **kwargs)`` on ``np``
    processes under mpiexec and returns their results as a list in rank
    order (func and its results are pickled: cloudpickle when installed).
    ``hosts``/``hostfile``/``mpi_args`` are gradsyncrun's. With ``min_np``
    or ``max_np`` the run is elastic (gradsyncrun --min-np: this host, a
    lost process does not end it, hvd.elastic shrinks the world): the
    results are those of the processes that finished, in their final rank
    order. ``reset_limit`` and Gloo raise NotImplementedError."""
    if reset_limit is not None:
        raise NotImplementedError("horovod.run(reset_limit=): gradsync's elastic runs have no "
                                  "reset limit; use min_np")
    elastic = min_np is not None or max_np is not None
    if use_gloo:
        raise NotImplementedError("horovod.run(use_gloo=True): gradsync runs on MPI only")
    folder = tempfile.mkdtemp(prefix="gradsync-run-")
    try:
        with open(os.path.join(folder, "func.pkl"), "wb") as f:
            _pickler().dump((func, tuple(args), dict(kwargs or {})), f)
        main_path = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_path and os.path.exists(main_path):  # see run_worker._load_callers_main
            with open(os.path.join(folder, "main_path"), "w") as f:
                f.write(os.path.abspath(main_path))
        argv = ["-np", str(np)]
        if hosts:
            argv += ["-H", hosts]
        if hostfile:
            argv += ["--hostfile", hostfile]
        if mpi_args:
            argv += ["--mpi-args", mpi_args]
        if verbose:
            argv += ["--verbose"]
        if min_np is not None:
            argv += ["--min-np", str(min_np)]
        if max_np is not None:
            argv += ["--max-np", str(max_np)]
        argv += [executable or sys.executable, "-m", "gradsync.horovod.run_worker", folder]
        env = dict(os.environ)
        horovod = sys.modules.get("horovod")
        paths = [p for p in sys.path if p]
        if getattr(horovod, "__gradsync__", False):  # the alias travels with the job
            from gradsync.horovod.alias import folder as alias_folder

            paths.insert(0, alias_folder())
        env["PYTHONPATH"] = os.pathsep.join(paths)
        args_ns = parser().parse_args(argv)
        if elastic:
            rc = elastic_launch.launch(args_ns, dict(environment(args_ns),
                                                     PYTHONPATH=env["PYTHONPATH"]))
            done = sorted(int(n.split(".")[1]) for n in os.listdir(folder)
                          if n.startswith("result."))
            return _results(folder, done, rc)
        args_ns.mpiexec = args_ns.mpiexec or find_mpiexec()
        cmd = command(args_ns, flavour(args_ns.mpiexec))
        out = None if output_filename is None else open(output_filename, "w")
        try:
            rc = subprocess.call(cmd, env=env, stdout=out, stderr=out)
        finally:
            if out is not None:
                out.close()
        return _results(folder, range(np), rc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _results(folder, ranks, rc):
    """What each rank's run_worker wrote, in rank order."""
    results = []
    for rank in ranks:
        path = os.path.join(folder, f"result.{rank}")
        if not os.path.exists(path):
            raise RuntimeError(f"horovod.run: rank {rank} returned no result (launcher exit {rc})")
        with open(path, "rb") as f:
            ok, value = _pickler().load(f)
        if not ok:
            raise RuntimeError(f"horovod.run: rank {rank} raised:\n{value}")
        results.append(value)
    return results
