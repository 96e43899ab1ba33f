#!/usr/bin/env bash
# stoke's own attention variants on a CPU under bf16, interleaved: train.attention = auto (fp32 SDPA
# beyond a context of 256), bf16 (SDPA in bf16), bf16-math (bf16 batched matmuls), for one preset.
# Prints each variant's median step per round.
#
#   benches/stoke_attention_cpu.sh [preset] [micro_batch] [steps] [skip] [rounds] [variants]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-gpt2-124m}; mb=${2:-1}; steps=${3:-5}; skip=${4:-2}; rounds=${5:-3}
variants=${6:-auto bf16 bf16-math}
dir=runs/stoke-attention-cpu
mkdir -p "$dir"
target/release/stoke corpus --out "$dir/corpus.txt" >/dev/null
prio=()
if chrt -f 20 true 2>/dev/null; then prio=(chrt -f 20); fi
for round in $(seq 1 "$rounds"); do
  line="round $round:"
  for attention in $variants; do
    name="$preset-$attention-$round"
    rm -rf "${dir:?}/$name"
    "${prio[@]}" target/release/stoke train --quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set run.name="$name" \
      --set model.preset="$preset" --set train.precision=bf16 --set train.attention="$attention" \
      --set train.micro_batch="$mb" --set train.steps="$steps" --set prof.skip_steps="$skip" \
      --set ckpt.every=0 --set ckpt.at_end=false --set prof.prometheus=false >/dev/null
    ms=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['step_ms'],1))" "$dir/$name/report.json")
    line="$line $attention $ms ms"
  done
  echo "$line"
done
