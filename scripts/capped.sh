#!/usr/bin/env bash
# Run a command inside a fresh memory cgroup (v1 or v2, needs root), so that "the model does not fit in memory" is
# measured the same way for offspec and for a peer such as llama.cpp (run each under the same cap):
#
#   bash scripts/capped.sh 1000M offspec generate --draft none --device-mem 550MB --max-new-tokens 64 --json "..."
#
# The page cache is dropped first. Afterwards one line on stderr gives the command's peak RSS (its largest process:
# anonymous, shared and mapped-file pages), the cgroup's peak use (that RSS plus the page cache of the files it read,
# which the kernel lets grow up to the cap before it reclaims any) and OOM kills.
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
rss=$(mktemp); trap 'rmdir "$cg" 2>/dev/null || true; rm -f "$rss"' EXIT
rc=0
# the command joins the cgroup as it starts; this small Python waiter stays outside it, and reads the peak RSS
waiter='
import os, resource, subprocess, sys
procs, out, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
def join():
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
try:
    child = subprocess.Popen(cmd, preexec_fn=join)
except OSError as e:
    sys.exit(f"capped.sh: cannot run {cmd[0]}: {e.strerror}")
while True:
    try:
        rc = child.wait()
        break
    except KeyboardInterrupt:  # the command got the same Ctrl-C: let it stop cleanly
        pass
with open(out, "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(rc if rc >= 0 else 128 - rc)
'
python3 -c "$waiter" "$cg/cgroup.procs" "$rss" "$@" || rc=$?
mb() { local n; n=$(cat "$1" 2>/dev/null); echo $(( ${n:-0} / 1000000 )); }
echo "capped.sh: cap $cap, peak RSS $(mb "$rss") MB, cgroup peak $(mb "$cg/$peak") MB (with page cache), $(kills)" >&2
exit $rc
