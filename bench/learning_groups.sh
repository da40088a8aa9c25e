# Sourced by the GPU learning scripts (learning_ceilings.sh, learning_search.sh) after they start
# their groups of bench/learning.py in the background:
#   finish_groups NAME OUT WORK
# waits for every group, says which failed, copies each run's log and events (not its adapters)
# from WORK to OUT/logs, prints the reports' tables, and returns 1 if a group exited non-zero.
finish_groups() {
  local name=$1 out=$2 work=$3 rc=0 p f
  for p in $(jobs -p); do wait "$p" || rc=1; done
  [ $rc = 0 ] || echo "$name: a group exited non-zero: see $out/*.log" >&2
  # The work folder may not come back from the GPU machine, and a run stopped at the deadline
  # has its held-out points only in its events.
  mkdir -p "$out/logs" && (cd "$work" && find . \( -name '*.log' -o -name events.jsonl \) -size -2048k \
    | tar -cf - -T - | tar -xf - -C "$out/logs")
  for f in "$out"/*/learning.md; do echo; echo "== $f"; sed -n '/^| task/,$p' "$f"; done
  return $rc
}
