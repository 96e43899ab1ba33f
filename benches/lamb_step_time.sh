#!/usr/bin/env bash
# Step time of the three runs of benches/lamb_batch.sh (AdamW at batch 16, LAMB and AdamW at 64),
# interleaved (A, B, C, A, B, C, ...) so that the machine's load falls on all three alike: each
# repeat is a short run of the same model and settings without evaluation, its median step time
# taken over the steps after the first five. Prints, per run, the median over the repeats with min
# and max, and the matmul peak measured alongside (`stoke bench limits`). Multiplied by the steps
# to the target loss from lamb_batch.sh, these give the wall time to that loss.
#
#   benches/lamb_step_time.sh [repeats] [binary] [lamb_lr]   (defaults: 3 target/release/stoke 0.0075)
# STOKE_SET adds `--set` overrides to every run (e.g. STOKE_SET="train.threads=1").
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
stoke=${2:-target/release/stoke}
lamb_lr=${3:-0.0075}
dir=runs/bench-lamb-step-time
mkdir -p "$dir"
model=(--set model.n_layer=2 --set model.d_model=128 --set model.n_head=4 --set model.seq_len=64)
common=(--set run.dir="$dir" --set train.micro_batch=16 --set train.lr_reference_batch=16
  --set train.lr_scaling=linear --set train.warmup_steps=30 --set ckpt.every=0 --set ckpt.at_end=false
  --set prof.prometheus=false)
for kv in ${STOKE_SET:-}; do common+=(--set "$kv"); done
"$stoke" bench limits --dir "$dir" --bytes 268435456 | grep -iE "matmul|gflop" || true
median_ms() { # metrics.jsonl -> median step_ms after the first five steps
  python3 -c 'import json, statistics, sys
ms = [json.loads(l)["step_ms"] for l in open(sys.argv[1]) if "\"step_ms\"" in l][5:]
print(round(statistics.median(ms), 1))' "$1"
}
declare -A times
for i in $(seq 1 "$repeats"); do
  for spec in "adamw-1x adamw 1 60 0.002" "lamb-4x lamb 4 20 $lamb_lr" "adamw-4x adamw 4 20 0.002"; do
    read -r name opt accum steps lr <<<"$spec"
    rm -rf "${dir:?}/$name-$i"
    "$stoke" train --quiet "${model[@]}" "${common[@]}" --set run.name="$name-$i" --set train.optimizer="$opt" \
      --set train.grad_accum="$accum" --set train.steps="$steps" --set train.lr="$lr" >/dev/null
    times[$name]+="$(median_ms "$dir/$name-$i/metrics.jsonl") "
  done
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
done
for name in adamw-1x lamb-4x adamw-4x; do
  python3 -c 'import statistics, sys
v = [float(x) for x in sys.argv[2].split()]
print(f"{sys.argv[1]}: median step {statistics.median(v):.1f} ms (min {min(v):.1f}, max {max(v):.1f}) over {len(v)} repeats: {v}")' \
    "$name" "${times[$name]}"
done
