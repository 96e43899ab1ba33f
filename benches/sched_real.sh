#!/usr/bin/env bash
# A real run of `stoke sched serve` under the goodput policy on this machine: three small training
# jobs on 2 slots (cores, each worker pinned to its slot's core). a (600 steps, 1..2 workers) starts
# alone: it profiles on 1 worker, then 2, and runs on both; b (150 steps, 1 worker) arrives once a
# has profiled, and a is shrunk to admit it; c (150 steps, 1 worker) arrives 5 s later and waits for
# b's slot; a grows back when the policy finds the measured gain pays for the resize. Prints the
# decisions with their reasons, each job's history, and `stoke sched report`: the simulator's
# completion times for the run (the measured throughput, start-up, profile and resize costs, the
# same policy and settings) against the measured ones, with the error. Also prints the machine's
# load before and after, since the jobs share the cores with whatever else runs.
#
#   benches/sched_real.sh [REPEATS]     (default 1; each repeat a fresh state folder)
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS="${1:-1}"
cargo build --quiet --bin stoke
STOKE="$PWD/target/debug/stoke"
WORK="$(mktemp -d)"
SERVER=""
cleanup() {
    if [[ -n "$SERVER" ]] && kill -0 "$SERVER" 2>/dev/null; then kill "$SERVER"; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
cp benches/sched_job.toml "$WORK/job.toml"
history_has() { # STATE JOB EVENT
    "$STOKE" sched status --dir "$1" --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
ids = [j["id"] for j in s["jobs"] if j["name"] == sys.argv[1]]
sys.exit(0 if ids and any(h["job"] == ids[0] and h["event"] == sys.argv[2] for h in s["history"]) else 1)' "$2" "$3"
}
for r in $(seq 1 "$REPEATS"); do
    STATE="$WORK/state-$r"
    echo "== run $r of $REPEATS ($(date -u +%FT%TZ)); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    "$STOKE" sched serve --dir "$STATE" --slots 2 --policy goodput --poll-s 0.2 --tick-s 2 \
        --min-resize-interval-s 10 --profile-steps 10 --exit-when-idle 2> "$WORK/serve-$r.log" &
    SERVER=$!
    until [[ -f "$STATE/sched.db" ]]; do sleep 0.1; done
    "$STOKE" sched submit --dir "$STATE" "$WORK/job.toml" --name a --max 2 --set train.steps=600
    until history_has "$STATE" a profiled || history_has "$STATE" a profile_cut; do sleep 0.2; done
    "$STOKE" sched submit --dir "$STATE" "$WORK/job.toml" --name b --max 1 --set train.steps=150
    sleep 5
    "$STOKE" sched submit --dir "$STATE" "$WORK/job.toml" --name c --max 1 --set train.steps=150
    wait "$SERVER"
    SERVER=""
    grep -E '^\[sched\] .* -> .* workers|profile' "$WORK/serve-$r.log" || true
    "$STOKE" sched status --dir "$STATE"
    "$STOKE" sched report --dir "$STATE"
    echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
done
