#!/usr/bin/env bash
# The episode loader against PyTorch's DataLoader on the same robot episodes (224x224 JPEG frames):
# stoke decoding and augmenting at training time (--keep-encoded), stoke on frames decoded at prep
# time, and the peer (torchvision decode_jpeg + transforms.v2 RandomResizedCrop and ColorJitter) at
# its best worker count, picked in this invocation. Rounds interleave A, B (order alternating);
# prints each ratio's median and [min, max] over the rounds.
# Usage: benches/episodes_vs_torch.sh [ROUNDS] [WORKERS]   (run from the repository root)
set -euo pipefail
rounds=${1:-5}
workers=${2:-2}
stoke=${STOKE:-target/release/stoke}
python=${PYTHON:-.stoke/venv/bin/python}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$stoke" corpus --episodes "$dir/raw" --n-episodes 64 --steps 16 --resolution 224 >/dev/null
"$stoke" prep episodes "$dir/raw" --out "$dir/enc" --keep-encoded --resolution 224 >/dev/null
"$stoke" prep episodes "$dir/raw" --out "$dir/dec" --resolution 224 >/dev/null
fps() { sed -E 's/.*"frames_per_s": ?([0-9.]+).*/\1/'; }
peer() { "$python" benches/peers/episodes_torch.py --data "$dir/raw" --workers "$1" --side 224 | fps; }
best=0; best_fps=0
for w in 0 1 2; do
  f=$(peer "$w"); echo "peer workers=$w: $f frames/s"
  if awk -v a="$f" -v b="$best_fps" 'BEGIN{exit !(a>b)}'; then best=$w; best_fps=$f; fi
done
echo "peer's best: $best workers"
enc=(); dec=(); torch=()
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then order="torch enc dec"; else order="dec enc torch"; fi
  for what in $order; do
    case $what in
      torch) torch+=("$(peer "$best")") ;;
      enc) enc+=("$("$stoke" bench episodes "$dir/enc" --workers "$workers" | fps)") ;;
      dec) dec+=("$("$stoke" bench episodes "$dir/dec" --workers "$workers" | fps)") ;;
    esac
  done
done
"$python" - "${enc[*]}" "${dec[*]}" "${torch[*]}" <<'PY'
import statistics, sys
enc, dec, torch = ([float(x) for x in a.split()] for a in sys.argv[1:4])
for name, xs in [("stoke, decode + augment", enc), ("stoke, pre-decoded + augment", dec)]:
    ratios = [a / b for a, b in zip(xs, torch)]
    print(f"{name}: {statistics.median(xs):.0f} frames/s; over the peer "
          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
print(f"peer: {statistics.median(torch):.0f} frames/s")
PY
