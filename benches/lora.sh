#!/usr/bin/env bash
# Fine-tuning step against transformers + peft (benches/peers/lora_peft.py): the same random-init
# Llama, written once by the peer with save_pretrained and read by stoke through model.from; LoRA
# adapters of rank 16 (alpha 32) on q_proj and v_proj with AdamW over the adapters, or (MODE=full)
# every weight trained, against plain PyTorch; micro-batch of the same corpus. Runs are interleaved
# (stoke, then each peer, then stoke again, ...); each side's figure is the median step time of its
# run after the first 3 steps, and its peak resident set.
#
#   benches/lora.sh [steps] [pairs] [precision]     (defaults: 30 3 fp32)
#   SIZE=tiny (4 layers, d 256, 2 kv heads, MLP 768, vocab 256, context 128, micro-batch 16; default)
#   SIZE=100m (12 layers, d 768, 12 heads, 4 kv heads, MLP 2048, vocab 16384, context 256,
#              micro-batch 8: 100.7M parameters)
#   MODE=lora (default) or full; PEERS="eager compiled" (default: eager): the peer eager and under
#   torch.compile (its first step, compilation included, is reported apart as first_step_s).
#   Under bf16 LoRA the peer loads its frozen base in bf16 (stoke keeps a bf16 copy of its frozen
#   weights); BASE_DTYPE=fp32 loads it in fp32 (autocast then casts it each step).
# Needs `cargo xtask test` (transformers, peft) once and a build of stoke (STOKE=path, default
# target/release/stoke).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
pairs=${2:-3}
precision=${3:-fp32}
size=${SIZE:-tiny}
mode=${MODE:-lora}
peers=${PEERS:-eager}
py=${PY:-.stoke/venv/bin/python}
base_dtype=${BASE_DTYPE:-$precision}
stoke=${STOKE:-target/release/stoke}
case "$size" in
  tiny) shape=(--layers 4 --d-model 256 --heads 4 --kv-heads 2 --ffn 768 --vocab 256 --seq 128); micro=16 ;;
  100m) shape=(--layers 12 --d-model 768 --heads 12 --kv-heads 4 --ffn 2048 --vocab 16384 --seq 256); micro=8 ;;
  *) echo "SIZE must be tiny or 100m" >&2; exit 2 ;;
esac
dir=runs/bench-lora-$size-$mode
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" benches/peers/lora_peft.py --save "$dir/base" "${shape[@]}" 2>/dev/null
results="$dir/results.jsonl"
: > "$results"
lora=()
[ "$mode" = lora ] && lora=(--set train.lora.rank=16 --set train.lora.alpha=32)

stoke_run() { # pair -> one JSON line
  local name="stoke-$1"
  "$stoke" train --quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set run.name="$name" \
    --set model.from="\"hf:$dir/base\"" "${lora[@]}" --set train.lr=0.001 \
    --set train.precision="\"$precision\"" --set train.micro_batch="$micro" --set train.steps="$steps" \
    --set train.threads=2 --set prof.skip_steps=3 --set ckpt.every=0 --set ckpt.at_end=false \
    --set prof.prometheus=false --set prof.html=false --set prof.trace=false >/dev/null
  python3 - "$dir/$name/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"side": "stoke", "step_ms": r["step_ms"], "peak_rss_bytes": r["peak_memory_bytes"],
                  "trainable": r["model"]["n_trainable_params"], "params": r["model"]["n_params"]}))
PY
}

for pair in $(seq 1 "$pairs"); do
  stoke_run "$pair" | tee -a "$results"
  for peer in $peers; do
    flag=(); [ "$peer" = compiled ] && flag=(--compile)
    "$py" benches/peers/lora_peft.py --base "$dir/base" --data "$dir/corpus.txt" --steps "$steps" \
      --precision "$precision" --base-dtype "$base_dtype" --mode "$mode" --micro-batch "$micro" \
      "${shape[@]}" "${flag[@]}" 2>/dev/null \
      | tee -a "$results"
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
stoke = [r for r in rows if r["side"] == "stoke"]
print(f"stoke: {statistics.median(r['step_ms'] for r in stoke):.1f} ms/step, peak RSS "
      f"{max(r['peak_rss_bytes'] for r in stoke) / 2**20:.0f} MiB, {stoke[0]['trainable']:,} trainable of {stoke[0]['params']:,}")
for side in sorted({r["side"] for r in rows} - {"stoke"}):
    peer = [r for r in rows if r["side"] == side]
    ratios = [s["step_ms"] / p["step_ms"] for s, p in zip(stoke, peer)]
    print(f"{side}: {statistics.median(r['step_ms'] for r in peer):.1f} ms/step, peak RSS "
          f"{max(r['peak_rss_bytes'] for r in peer) / 2**20:.0f} MiB, first step {peer[0]['first_step_s']:.1f} s; "
          f"stoke/peer per pair {', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}, "
          f"spread {min(ratios):.3f}-{max(ratios):.3f})")
PY
