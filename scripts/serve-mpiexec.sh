#!/usr/bin/env bash
# An example without a scheduler: N ranks of `fanstore serve` under mpiexec. On one machine (a laptop, the
# tests), {rank} gives each rank its own mount point and local directory; on several hosts, give mpiexec a host
# file and one rank per host (`mpiexec -n 4 -ppn 1 -f hosts ...`) and drop the {rank}s.
#
#   scripts/serve-mpiexec.sh DATASET [N]
#
# fanstore and mpiexec are the ones scripts/setup put in this checkout's .venv, so the venv need not be active
# (where there is no .venv, those on PATH; MPIEXEC=... names another mpiexec, one that matches fanstore's mpi4py).
# The temporary directory of mount points and local chunks is removed however the script ends: done, failed,
# Ctrl-C or SIGTERM (which stops the job first).
set -euo pipefail

DATASET=${1:?usage: scripts/serve-mpiexec.sh DATASET [N]}
N=${2:-2}
VENV_BIN=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin

find_command() {  # the venv's, else PATH's; says what is missing and how to get it
    if [ -x "$VENV_BIN/$1" ]; then
        echo "$VENV_BIN/$1"
    elif command -v "$1" >/dev/null; then
        command -v "$1"
    else
        echo "serve-mpiexec.sh: no $1 in $VENV_BIN or on PATH: run scripts/setup" >&2
        return 1
    fi
}
FANSTORE=$(find_command fanstore)
MPIEXEC=${MPIEXEC:-$(find_command mpiexec)}

WORK=$(mktemp -d)
JOB_PID=
cleanup() {
    if [ -n "$JOB_PID" ]; then  # interrupted: end the job before removing the directories it uses
        kill -TERM "$JOB_PID" 2>/dev/null || true
        wait "$JOB_PID" 2>/dev/null || true
    fi
    for mountpoint in "$WORK"/mount*; do  # a mount a killed job left: unmounted, never deleted through
        if [ -d "$mountpoint" ] && mountpoint -q "$mountpoint"; then
            "$FANSTORE" umount "$mountpoint" >/dev/null 2>&1 || true
        fi
    done
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for rank in $(seq 0 $((N - 1))); do mkdir -p "$WORK/mount$rank"; done

# Every rank counts the dataset's files through its mount; the job's status is the worst rank's. The job runs in the
# background so that a signal reaches this script's trap at once, not when the job ends.
"$MPIEXEC" -n "$N" "$FANSTORE" serve "$DATASET" "$WORK/mount{rank}" --local-dir "$WORK/local{rank}" --stats \
    -- sh -c 'echo "rank $FANSTORE_RANK of $FANSTORE_SIZE sees $(find "$FANSTORE_MOUNT" -type f | wc -l) files"' &
JOB_PID=$!
status=0
wait "$JOB_PID" || status=$?
JOB_PID=
exit "$status"
