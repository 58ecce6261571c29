#!/usr/bin/env bash
# An example without a scheduler: N ranks of `fanstore serve` under mpiexec. On one machine (a laptop, the
# tests), {rank} gives each rank its own mount point and local directory; on several hosts, give mpiexec a host
# file and one rank per host (`mpiexec -n 4 -ppn 1 -f hosts ...`) and drop the {rank}s.
#
#   scripts/serve-mpiexec.sh DATASET [N]
set -euo pipefail

DATASET=${1:?usage: scripts/serve-mpiexec.sh DATASET [N]}
N=${2:-2}
WORK=$(mktemp -d)
for rank in $(seq 0 $((N - 1))); do mkdir -p "$WORK/mount$rank"; done

# Every rank lists the dataset and reads one file; the job's status is the worst rank's.
mpiexec -n "$N" fanstore serve "$DATASET" "$WORK/mount{rank}" --local-dir "$WORK/local{rank}" --stats \
    -- sh -c 'echo "rank $FANSTORE_RANK of $FANSTORE_SIZE sees $(find "$FANSTORE_MOUNT" -type f | wc -l) files"'
rm -rf "$WORK"
