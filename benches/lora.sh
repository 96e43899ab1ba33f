#!/usr/bin/env bash
# LoRA fine-tuning step against transformers + peft (benches/peers/lora_peft.py): the same
# random-init Llama (4 layers, d 256, 4 heads, 2 key/value heads, MLP 768, vocab 256, context 128),
# written once by the peer with save_pretrained and read by stoke through model.from; adapters of
# rank 16 (alpha 32) on q_proj and v_proj; AdamW over the adapters; micro-batch 16 of the same
# corpus. Runs are interleaved (stoke, peer, stoke, peer, ...); each side's figure is the median
# step time of its run after the first 3 steps.
#
#   benches/lora.sh [steps] [pairs] [precision]     (defaults: 30 3 fp32)
# Needs `cargo xtask test` (transformers, peft) once and a build of stoke (STOKE=path, default
# target/release/stoke).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
pairs=${2:-3}
precision=${3:-fp32}
py=.stoke/venv/bin/python
stoke=${STOKE:-target/release/stoke}
dir=runs/bench-lora
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" benches/peers/lora_peft.py --save "$dir/base" 2>/dev/null
results="$dir/results.jsonl"
: > "$results"

stoke_run() { # pair -> one JSON line
  local name="stoke-$1"
  "$stoke" train --quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set run.name="$name" \
    --set model.from="\"hf:$dir/base\"" --set train.lora.rank=16 --set train.lora.alpha=32 \
    --set train.precision="\"$precision\"" --set train.micro_batch=16 --set train.steps="$steps" \
    --set train.threads=2 --set prof.skip_steps=3 --set ckpt.every=0 --set ckpt.at_end=false \
    --set prof.prometheus=false --set prof.html=false --set prof.trace=false >/dev/null
  python3 - "$dir/$name/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"side": "stoke", "step_ms": r["step_ms"], "trainable": r["model"]["n_trainable_params"]}))
PY
}

for pair in $(seq 1 "$pairs"); do
  stoke_run "$pair" | tee -a "$results"
  "$py" benches/peers/lora_peft.py --base "$dir/base" --data "$dir/corpus.txt" --steps "$steps" \
    --precision "$precision" 2>/dev/null | tee -a "$results"
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
stoke = [r["step_ms"] for r in rows if r["side"] == "stoke"]
peer = [r["step_ms"] for r in rows if r["side"] != "stoke"]
ratios = [s / p for s, p in zip(stoke, peer)]
print(f"stoke {statistics.median(stoke):.1f} ms/step, transformers+peft {statistics.median(peer):.1f} ms/step, "
      f"stoke/peer per pair {', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")
PY
