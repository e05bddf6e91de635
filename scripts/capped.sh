#!/usr/bin/env bash
# Run a command inside a fresh memory cgroup (v1 or v2, needs root), so that "the model does not fit in memory" is
# measured the same way for offspec and for a peer such as llama.cpp (run each under the same cap):
#
#   bash scripts/capped.sh 1000M offspec generate --draft none --device-mem 550MB --max-new-tokens 64 --json "..."
#
# The page cache is dropped first. Afterwards one line on stderr gives the cgroup's peak use and OOM kills.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,7p "$0"; exit 2; }
cap=$1; shift
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "capped.sh: cannot drop the page cache (not root?)" >&2
if [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/offspec$$; mkdir "$cg"; echo "$cap" > "$cg/memory.limit_in_bytes"
  peak=memory.max_usage_in_bytes; kills() { grep oom_kill "$cg/memory.oom_control" | tr '\n' ' '; }
else
  cg=/sys/fs/cgroup/offspec$$; mkdir "$cg"; echo "$cap" > "$cg/memory.max"
  peak=memory.peak; kills() { grep oom_kill "$cg/memory.events" | tr '\n' ' '; }
fi
trap 'rmdir "$cg" 2>/dev/null || true' EXIT  # also when interrupted
rc=0
(echo $BASHPID > "$cg/cgroup.procs"; exec "$@") || rc=$?
echo "capped.sh: cap $cap, peak $(( $(cat "$cg/$peak" 2>/dev/null || echo 0) / 1000000 )) MB, $(kills)" >&2
exit $rc
