#!/usr/bin/env bash
# Run a benchmark once the machine is quiet: wait (up to $WAIT seconds, default 900) until the CPUs
# have been at least $IDLE percent idle (default 95) over 3 seconds, then run "$@" holding
# /tmp/lmdock-bench.lock, so two benchmarks started this way never overlap.
#   bash benchmarks/quiet.sh python benchmarks/mlx.py --stories-only
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bash benchmarks/quiet.sh COMMAND [ARGS...]" >&2; exit 2; }
deadline=$(( $(date +%s) + ${WAIT:-900} ))
idle_total() { read -r _ u n s i w x y z _ < /proc/stat; echo $((i + w)) $((u + n + s + i + w + x + y + z)); }
while [ "$(date +%s)" -lt "$deadline" ]; do
  read -r i1 t1 < <(idle_total); sleep 3; read -r i2 t2 < <(idle_total)
  pct=$(( 100 * (i2 - i1) / (t2 - t1 > 0 ? t2 - t1 : 1) ))
  if [ "$pct" -ge "${IDLE:-95}" ]; then
    echo "# machine ${pct}% idle over 3 s at $(date +%T); running" >&2
    exec flock /tmp/lmdock-bench.lock "$@"
  fi
done
echo "# the machine was never ${IDLE:-95}% idle within ${WAIT:-900} s; running anyway at $(date +%T)" >&2
exec flock /tmp/lmdock-bench.lock "$@"
