#!/usr/bin/env bash
# stoke train against PyTorch training the same GPT on the same bytes with the same batch, precision
# and optimizer, like with like, from interleaved repeats (see benches/train_vs_pytorch.py for what
# each of the five configurations is and how the ratios are taken):
#
#   stoke defaults          / tuned PyTorch, compiled   (S/PC)
#   stoke defaults          / tuned PyTorch, eager      (S/PE)
#   stoke, all of its own off / plain PyTorch           (SO/PP)
#
# Step-time ratios, median [min, max] over the rounds, for each preset and precision; MFU against the
# bf16 matmul peak measured in the same rounds; the tuned peer's attention picked by measurement first.
#
#   benches/train_vs_pytorch.sh [--rounds 3] [--pick-rounds 2] [--presets tiny,small,gpt2-124m]
#                               [--precisions bf16,fp32] [--realtime] [--out runs/train-vs-pytorch]
#
# Needs a release build (`cargo build --release --bin stoke`) and the peers' Python
# (`cargo xtask peers`: torch and numpy in .stoke/venv). All figures: <out>/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x target/release/stoke ]]; then
  echo "train_vs_pytorch: no target/release/stoke; run: cargo build --release --bin stoke" >&2
  exit 2
fi
if ! .stoke/venv/bin/python -c 'import torch, numpy' 2>/dev/null; then
  echo "train_vs_pytorch: .stoke/venv cannot import torch and numpy; run: cargo xtask peers" >&2
  exit 2
fi
exec python3 benches/train_vs_pytorch.py "$@"
