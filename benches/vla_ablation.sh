#!/usr/bin/env bash
# Does stoke's vision-language-action model use what it sees and what it is told? Trains the same
# model three times on the same robot episodes (the built-in set unless DATA names a prepared
# folder): as is, with every frame blanked (data.blank = "frames") and with every instruction
# blanked (data.blank = "instructions"), the blanking applied to training and held-out samples
# alike. Each run reports its held-out action error (report: eval_loss, the squared error of the
# chunk the flow integrates to, in normalized action units) every EVAL_EVERY steps; the script
# prints each run's last and best error and the ratios of the model's to each ablation's.
#
#   benches/vla_ablation.sh [STEPS]            (default 2000)
#   PRESET=vla-tiny  MICRO_BATCH=32  LR=1e-3  EVAL_EVERY=500  EVAL_BATCHES=32  SEED=1337  DATA=""   (a prepared episodes folder)
# (at the default train.lr, 2e-3, the keypoint maps sharpen, their gradients spike and the loss climbs)
#   STOKE=target/release/stoke (built when missing)
#   SET="train.instruction_lm=0.5 ..." (more settings, the same for all three runs)
# Every run: runs/bench-vla-ablation/<none|frames|instructions>/.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-2000}
preset=${PRESET:-vla-tiny}
micro=${MICRO_BATCH:-32}
lr=${LR:-1e-3}
every=${EVAL_EVERY:-500}
eval_batches=${EVAL_BATCHES:-32}
seed=${SEED:-1337}
data=${DATA:-}
stoke=${STOKE:-target/release/stoke}
dir=runs/bench-vla-ablation
if [[ ! -x "$stoke" ]] || ! grep -qa "vla-tiny" "$stoke"; then
  echo "vla_ablation: $stoke is missing or predates the vla family; building it" >&2
  cargo build --release --bin stoke
  stoke=target/release/stoke
fi
extra=()
for setting in ${SET:-}; do extra+=(--set "$setting"); done
rm -rf "$dir" && mkdir -p "$dir"
for blank in none frames instructions; do
  echo "vla_ablation: training with data.blank = $blank ($steps steps)" >&2
  "$stoke" train --quiet --set run.dir="$dir" --set run.name="$blank" \
    --set model.family=vla --set model.preset="$preset" --set data.path="\"$data\"" \
    --set data.blank="$blank" --set train.steps="$steps" --set train.micro_batch="$micro" --set train.lr="$lr" \
    --set train.seed="$seed" --set eval.every="$every" --set eval.batches="$eval_batches" --set ckpt.every=0 --set ckpt.at_end=false "${extra[@]}"
done
python3 - "$dir" <<'EOF'
import json, sys, pathlib
runs = pathlib.Path(sys.argv[1])
errors = {}
for blank in ["none", "frames", "instructions"]:
    evals = [json.loads(line) for line in (runs / blank / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["eval_loss"]) for e in evals if "eval_loss" in e]
    last, best = evals[-1][1], min(v for _, v in evals)
    errors[blank] = last
    curve = " ".join(f"{s}:{v:.3f}" for s, v in evals)
    print(f"{blank:>12}: held-out action error last {last:.4f}, best {best:.4f} | {curve}")
for ablation in ["frames", "instructions"]:
    print(f"model / blanked {ablation}: {errors['none'] / errors[ablation]:.3f} (last evaluations)")
EOF
