#!/usr/bin/env bash
# The pipeline bubble stoke measures against the formula, in interleaved rounds over schedules and
# micro-batch counts (round 1: 1f1b m=4, 1f1b m=8, gpipe m=4, gpipe m=8, interleaved m=4, interleaved
# m=8; round 2: the same ...):
#
#   `stoke launch --nproc 2 -- train --set dist.pipeline=2 --set train.grad_accum=M` on the built-in corpus,
#   the profiler on; report.json's `pipeline` section gives each stage's busy time (its schedule's span less
#   its waits on the other stage), the schedule's span (the longer stage's) and the bubble 1 - busy / span,
#   against (p - 1) / (m + p - 1), and for the interleaved schedule (2 chunks a stage, one block each with
#   the embedding in the first and the head in the last) against (p - 1) / (2m + p - 1).
#
# fp32 on the CPU, 1 libtorch thread per rank, no loader thread, no checkpoints. Per run it prints the
# measured bubble (mean over the stages), each stage's busy ms and the formula; at the end the median and
# [min, max] over the rounds of each.
#
#   benches/pipeline_bubble.sh                # ROUNDS=3 STEPS=12 SIZE=small STOKE=target/release/stoke
#
# SIZE small: 4 layers, d_model 256, 8 heads, context 256, micro-batch 4, vocab 256 (bytes).
# Needs a release build (cargo build --release --bin stoke).
set -euo pipefail
# As dp_scaling.sh: restarted under setsid so the run is its own scheduling group, niced -20 when allowed.
if [ -z "${PIPELINE_BUBBLE_SETSID:-}" ] && command -v setsid >/dev/null; then
  PIPELINE_BUBBLE_SETSID=1 exec setsid -w "$0" "$@"
fi
echo -20 >"/proc/$$/autogroup" 2>/dev/null || echo "pipeline_bubble: cannot raise this group's priority; figures share the cores" >&2
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
steps=${STEPS:-12}
case "${SIZE:-small}" in
  small) n_layer=4 d_model=256 n_head=8 seq_len=256 micro_batch=4 ;;
  *) echo "pipeline_bubble: SIZE is small" >&2; exit 2 ;;
esac
stoke=${STOKE:-target/release/stoke}
[ -x "$stoke" ] || { echo "pipeline_bubble: no $stoke (cargo build --release --bin stoke)" >&2; exit 1; }
dir=runs/pipeline-bubble
rm -rf "$dir" && mkdir -p "$dir"
echo "code $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates src 2>/dev/null || echo ' (+ uncommitted Rust changes)'); binary built $(date -r "$stoke" '+%F %T')"
echo "n_layer $n_layer, d_model $d_model, context $seq_len, micro-batch $micro_batch; 2 stages; $steps steps; $rounds rounds"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc)"

results="$dir/runs.txt"
: >"$results"
for round in $(seq 1 "$rounds"); do
  for schedule in 1f1b gpipe interleaved; do
    for m in 4 8; do
      name="$schedule-m$m-$round"
      "$stoke" launch --nproc 2 -- train --quiet --set dist.pipeline=2 --set "dist.pipeline_schedule=\"$schedule\"" \
        --set run.dir="$dir" --set run.name="$name" --set model.n_layer="$n_layer" --set model.d_model="$d_model" \
        --set model.n_head="$n_head" --set model.seq_len="$seq_len" --set train.micro_batch="$micro_batch" \
        --set train.grad_accum="$m" --set train.steps="$steps" --set train.precision=fp32 --set train.threads=1 \
        --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false --set prof.enabled=true \
        $([ "$schedule" = interleaved ] && echo '--set dist.pipeline_split="2,1,1,2"') \
        >"$dir/$name.log" 2>&1 || { tail -20 "$dir/$name.log" >&2; exit 1; }
      python3 - "$dir/$name/report.json" "$schedule" "$m" <<'PY' | tee -a "$results"
import json, sys
p = json.load(open(sys.argv[1]))["pipeline"]
busy = " ".join(f"{s['busy_ms']:.1f}" for s in p["per_stage"])
print(f"RUN schedule={sys.argv[2]} m={sys.argv[3]} bubble={p['bubble']:.4f} formula={p['formula']:.4f} "
      f"span={p['span_ms']:.1f} busy={busy.replace(' ', ',')}")
PY
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("RUN"):
        kv = dict(x.split("=") for x in line.split()[1:])
        runs[(kv["schedule"], int(kv["m"]))].append(kv)
print("| schedule | m | bubble measured, median [min, max] | formula | stage busy ms (median) | span ms |")
print("|---|---|---|---|---|---|")
for (schedule, m), rs in sorted(runs.items()):
    b = sorted(float(r["bubble"]) for r in rs)
    busy = [statistics.median(float(r["busy"].split(",")[i]) for r in rs) for i in range(2)]
    span = statistics.median(float(r["span"]) for r in rs)
    print(f"| {schedule} | {m} | {100*statistics.median(b):.1f}% [{100*b[0]:.1f}, {100*b[-1]:.1f}] | "
          f"{100*float(rs[0]['formula']):.1f}% | {busy[0]:.0f}, {busy[1]:.0f} | {span:.0f} |")
PY
