#!/usr/bin/env bash
# Issue 2's benchmark: `stoke train` against the PyTorch peer training the same GPT on the same
# bytes with the same batch, precision and optimizer, interleaved in one run. Prints step-time
# ratios (stoke / PyTorch; at most 1.0 means no overhead of our own).
#
#   benches/train_vs_pytorch.sh [steps] [rounds]
# Needs `cargo xtask peers` (numpy etc. for the peer) and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}
rounds=${2:-2}
py=.stoke/venv/bin/python
stoke=target/release/stoke
dir=runs/train-vs-pytorch
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
# Real-time priority when allowed, so both sides see the same quiet cores on a shared machine.
prio=()
if chrt -f 10 true 2>/dev/null; then prio=(chrt -f 10); fi
median_stoke() { # metrics.jsonl -> median step_ms without the first 5 steps
  python3 -c "import json,sys; v=sorted(json.loads(l)['step_ms'] for l in open(sys.argv[1]).readlines()[5:]); print(v[len(v)//2])" "$1"
}
for precision in bf16 fp32; do
  for round in $(seq 1 "$rounds"); do
    name="$precision-$round"
    "${prio[@]}" "$stoke" train --quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set run.name="$name" \
      --set train.steps="$steps" --set train.precision="$precision" --set ckpt.every=0 --set ckpt.at_end=false \
      --set prof.prometheus=false >/dev/null
    ours=$(median_stoke "$dir/$name/metrics.jsonl")
    peer=$("${prio[@]}" "$py" benches/peers/train_gpt.py --data "$dir/corpus.txt" --steps "$steps" --precision "$precision" \
      | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['step_ms'])")
    python3 -c "import sys; o,p=float(sys.argv[2]),float(sys.argv[3]); print(f'{sys.argv[1]:<8} stoke {o:8.1f} ms  pytorch {p:8.1f} ms  stoke/pytorch {o/p:.3f}')" "$name" "$ours" "$peer"
  done
done
