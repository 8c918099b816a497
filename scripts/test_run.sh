#!/bin/sh
# The run folder of `make test` and of every test target run on its own
# (docs/DEVELOPERS.md "Temporary files", docs/decisions/build.md): one folder made
# under the user's TMPDIR when make starts, handed to everything the run
# starts as TMPDIR (tempfile, mktemp, pytest's base directories, torch's
# FileStore files and torchelastic's logs all follow it), and removed when
# make exits: passed, failed or interrupted. KEEP_TEST_FILES=1 keeps it.
#
#   scripts/test_run.sh start MAKE_PID   makes the folder, prints its path,
#                                        and leaves a watcher that removes it
#                                        once MAKE_PID has exited
#                                        (and the process groups named in
#                                        RUN/.run/*.pgid, started in the
#                                        background and not waited for)
#   scripts/test_run.sh check RUN        fails naming the entries the run
#                                        left in the user's own TMPDIR
#   scripts/test_run.sh background RUN NAME CMD...
#                                        runs CMD niced in a process group of
#                                        its own (named in RUN/.run/, so the
#                                        watcher ends it if make stops first),
#                                        its output in RUN/background/NAME.log
#   scripts/test_run.sh wait RUN NAME SECONDS
#                                        waits for it, prints its output, and
#                                        exits with its status
#
# The Makefile calls `start` while it reads itself (so the folder exists
# before any recipe runs, whichever targets were asked for) and `check` as
# the last step of `make test`.
set -u

# Names the run's own programs give what they make in TMPDIR: gradsync's
# (gradsync-*, gs-*), pytest's, torchelastic's. Only these are compared:
# TMPDIR is shared with whatever else this user runs at the same time.
OURS='gs-* gs_* gradsync* pytest-of-* torchelastic_* pymp-*'

ours() {
  for pattern in $OURS; do
    case "$1" in $pattern) return 0 ;; esac
  done
  return 1
}

# hydra (MPICH's mpiexec) writes the machine's topology to
# /tmp/hydra_hwloc_xmlfile_* for its ranks, whatever TMPDIR says, and a job
# that ends in MPI_Abort leaves the file there. Given HWLOC_XMLFILE it
# writes none: the same topology, copied once from a 1-rank job (its
# launcher holds the file open while the job runs). Nothing when there is
# no MPI with mpi4py yet (the first `make` installs them) or it is not hydra.
topology() {
  [ -n "${MPIEXEC:-}" ] && [ -x "$MPIEXEC" ] || return 0
  TMPDIR=$1 timeout 120 "$MPIEXEC" -n 1 "${PYTHON:-python3}" -c '
import os, shutil, sys
from mpi4py import MPI  # noqa: F401  (MPI_Init: hydra writes the file for its ranks)
fds = "/proc/%d/fd" % os.getppid()
for fd in os.listdir(fds):
    try:
        path = os.readlink(os.path.join(fds, fd))
    except OSError:
        continue
    if os.path.basename(path).startswith("hydra_hwloc_xmlfile_"):
        shutil.copyfile(path, sys.argv[1])
        break
' "$1/hwloc-topology.xml" >/dev/null 2>&1 || rm -f "$1/hwloc-topology.xml"
}

start() {
  pid=$1
  real=${TMPDIR:-/tmp}
  run=$(mktemp -d "$real/gradsync-test-run.XXXXXX") || exit 1
  mkdir "$run/.run"
  printf '%s\n' "$real" > "$run/.run/tmpdir"
  ls -A "$real" > "$run/.run/before" 2>/dev/null
  topology "$run"
  # The watcher outlives this shell (make's $(shell) returns at once) and
  # ignores the Ctrl-C that stops make, so an interrupted run is removed too.
  if [ -z "${KEEP_TEST_FILES:-}" ] || [ "$KEEP_TEST_FILES" = 0 ]; then
    (
      trap '' INT HUP
      while kill -0 "$pid" 2>/dev/null; do sleep 1; done
      # what the run started in the background and did not wait for (make
      # stopped early): its process group, named in .run/*.pgid
      for f in "$run"/.run/*.pgid; do
        [ -f "$f" ] && kill -TERM -- "-$(cat "$f")" 2>/dev/null
      done
      rm -rf "$run"
    ) </dev/null >/dev/null 2>&1 &
  fi
  printf '%s\n' "$run"
}

check() {
  run=${1:-}
  if [ -z "$run" ] || ! [ -f "$run/.run/tmpdir" ]; then
    echo "== TMPDIR not checked: no run folder made by scripts/test_run.sh"
    return 0
  fi
  real=$(cat "$run/.run/tmpdir")
  me=$(id -u)
  left=""
  for path in "$real"/* "$real"/.[!.]*; do
    [ -e "$path" ] || [ -L "$path" ] || continue
    name=${path##*/}
    [ "$path" = "$run" ] && continue
    ours "$name" || continue
    # new since the listing made at the start, and this user's (not compared
    # by time: a file made in the same clock tick as the start mark is not
    # -newer than it, and the check missed such an entry)
    grep -qxF -- "$name" "$run/.run/before" && continue
    [ -n "$(find "$path" -maxdepth 0 -user "$me" 2>/dev/null)" ] || continue
    left="$left
  $path"
  done
  if [ -n "$left" ]; then
    echo "== make test left these in $real (its tests must use the run folder, TMPDIR):$left"
    echo "   (made during this run by this user; another gradsync run of yours sharing $real"
    echo "   at the same time would make such names too: give it a TMPDIR of its own)"
    return 1
  fi
  echo "== $real: nothing left by this run"
}

# A tier run beside the others (make test's bg-start-%): its status lands in
# NAME.rc when it ends, whatever its output.
background() {
  run=$1 name=$2
  shift 2
  mkdir -p "$run/background"
  rm -f "$run/background/$name.rc"
  # setsid: a group of its own, which the watcher can end as a whole
  setsid nice -n 10 sh -c '"$@" >"$0.log" 2>&1; echo $? >"$0.rc"' \
    "$run/background/$name" "$@" </dev/null >/dev/null 2>&1 &
  echo $! > "$run/.run/background-$name.pgid"
}

wait_for() {
  run=$1 name=$2 limit=$3
  base=$run/background/$name
  waited=0
  while ! [ -f "$base.rc" ]; do
    if [ "$waited" -ge "$limit" ] || ! kill -0 "$(cat "$run/.run/background-$name.pgid")" 2>/dev/null &&
       ! [ -f "$base.rc" ]; then
      echo "== $name, run in the background, ended without a status (or took over $limit s):"
      cat "$base.log" 2>/dev/null
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  # ended: the watcher must not signal a group id the system may reuse
  rm -f "$run/.run/background-$name.pgid"
  echo "== $name (run in the background beside the tiers above):"
  cat "$base.log"
  return "$(cat "$base.rc")"
}

case "${1:-}" in
  start) start "${2:?MAKE_PID}" ;;
  check) check "${2:-}" ;;
  background) [ $# -ge 4 ] || { echo "usage: $0 background RUN NAME CMD..." >&2; exit 2; }
              shift; background "$@" ;;
  wait) wait_for "${2:?RUN}" "${3:?NAME}" "${4:?SECONDS}" ;;
  *) echo "usage: $0 start MAKE_PID | check RUN_FOLDER | background RUN NAME CMD... |" \
          "wait RUN NAME SECONDS" >&2; exit 2 ;;
esac
