#!/usr/bin/env bash
# What one step change bought: the same short training run with two stoke binaries, A (before the
# change) and B (after), interleaved A, B, B, A, A, B, ... so the machine's load falls on both alike.
# Both sides run at real-time priority (`chrt -f 10`, when allowed) so other work on the machine
# takes less of their time. Each run's step time is the median of its steps after the first
# `skip` (its fastest step beside it); printed per pair, then
# the median of A's and B's run medians (min/max beside) and the median of the per-pair ratios
# B/A with their min and max. Also each side's effective compute ratio (report.json) and the bf16
# matmul peak measured alongside (`stoke bench limits`, B's binary), the physical limit.
#
#   benches/step_changes.sh A_BINARY B_BINARY [pairs] [preset] [precision] [steps]
#       (defaults: 3 small bf16 30; STOKE_SET adds `--set` overrides to both sides, STOKE_SET_A and
#       STOKE_SET_B to one side: the same binary twice with a switch off and on measures that switch)
# Results: runs/bench-step-changes/<B binary name>-<preset>-<precision>/results.jsonl, one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
a=${1:?A binary}
b=${2:?B binary}
pairs=${3:-3}
preset=${4:-small}
precision=${5:-bf16}
steps=${6:-30}
skip=5
dir=runs/bench-step-changes/$(basename "$b")-$preset-$precision
rm -rf "$dir" && mkdir -p "$dir"
"$b" corpus --out "$dir/corpus.txt" >/dev/null
common=(--data "$dir/corpus.txt" --set run.dir="$dir" --set model.preset="$preset"
  --set train.precision="$precision" --set train.steps="$steps" --set train.micro_batch=16
  --set prof.skip_steps=$skip --set ckpt.every=0 --set ckpt.at_end=false --set prof.prometheus=false
  --set prof.html=false --set prof.trace=false)
for kv in ${STOKE_SET:-}; do common+=(--set "$kv"); done
"$b" bench limits --dir "$dir" --bytes 268435456 | grep -iE "matmul|gflop" || true
results="$dir/results.jsonl"
: > "$results"
prio=()
if chrt -f 10 true 2>/dev/null; then prio=(chrt -f 10); fi
run() { # side binary pair -> one JSON line
  local name="$1-$3" own=() var="STOKE_SET_$1"
  for kv in ${!var:-}; do own+=(--set "$kv"); done
  "${prio[@]}" "$2" train --quiet "${common[@]}" "${own[@]}" --set run.name="$name" >/dev/null
  python3 - "$dir/$name" "$1" "$3" "$skip" <<'PY'
import json, statistics, sys
run, side, pair, skip = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ms = [json.loads(l)["step_ms"] for l in open(run + "/metrics.jsonl") if '"step_ms"' in l][skip:]
report = json.load(open(run + "/report.json"))
losses = [json.loads(l).get("loss") for l in open(run + "/metrics.jsonl") if '"loss"' in l]
print(json.dumps({"side": side, "pair": pair, "step_ms": statistics.median(ms), "min_step_ms": min(ms),
                  "compute_ratio": report.get("effective_compute_ratio"), "final_loss": losses[-1]}))
PY
}
# Odd pairs run A then B, even pairs B then A: the second run of a pair was measured about 5% slower
# than the first on gpt2-124m whichever binary it was (2026-12-03, 3 pairs each way), so a fixed order
# would charge that to B.
for pair in $(seq 1 "$pairs"); do
  if (( pair % 2 )); then
    run A "$a" "$pair" | tee -a "$results"
    run B "$b" "$pair" | tee -a "$results"
  else
    run B "$b" "$pair" | tee -a "$results"
    run A "$a" "$pair" | tee -a "$results"
  fi
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
done
python3 - "$results" "$preset" "$precision" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
side = lambda s: [r for r in rows if r["side"] == s]
ms = lambda s: [r["step_ms"] for r in side(s)]
ratios = [b["step_ms"] / a["step_ms"] for a, b in zip(side("A"), side("B"))]
min_ratios = [b["min_step_ms"] / a["min_step_ms"] for a, b in zip(side("A"), side("B"))]
fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
cr = lambda s: statistics.median([r["compute_ratio"] for r in side(s)])
print(f"{sys.argv[2]} {sys.argv[3]}: A {fmt(ms('A'))} ms, B {fmt(ms('B'))} ms; "
      f"B/A median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
      f"fastest steps B/A median {statistics.median(min_ratios):.3f} ({min(min_ratios):.3f}-{max(min_ratios):.3f}); "
      f"compute ratio A {cr('A'):.3f}, B {cr('B'):.3f}; {len(ratios)} pairs")
PY
