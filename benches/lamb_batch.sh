#!/usr/bin/env bash
# Large-batch training (issue 15): LAMB at 4x the batch with the linearly scaled learning rate
# against AdamW at the base batch, and AdamW at 4x with the same rule, on the built-in corpus
# with the same tokens. Each run evaluates on the corpus's held-out tail every eval_every_tokens;
# `stoke compare` lines the curves up by tokens seen and prints the final evaluation losses and
# where each run first reached AdamW-at-base's final evaluation loss (+3%): tokens and seconds of
# step time (the sum of the runs' step times, so time spent evaluating is not counted).
#
# LAMB moves each tensor by lr x its norm per step, a different scale from AdamW's, so its
# reference rate (at the base batch, before the rule's 4x) is its own: lamb_lr.
#
#   benches/lamb_batch.sh [base_steps] [binary] [lamb_lr] [runs]
#       (defaults: 600 target/release/stoke 0.01 "adamw-1x lamb-4x adamw-4x")
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-600}
stoke=${2:-target/release/stoke}
lamb_lr=${3:-0.01}
runs=${4:-adamw-1x lamb-4x adamw-4x}
dir=runs/bench-lamb-batch
mkdir -p "$dir"
model=(--set model.n_layer=2 --set model.d_model=128 --set model.n_head=4 --set model.seq_len=64)
common=(--set run.dir="$dir" --set train.micro_batch=16 --set train.lr_reference_batch=16
  --set train.lr_scaling=linear --set train.warmup_steps=30 --set eval.batches=8 --set ckpt.every=0
  --set ckpt.at_end=false --set prof.prometheus=false)
run() { # name optimizer grad_accum steps lr min_lr
  [[ " $runs " == *" $1 "* ]] || return 0
  rm -rf "${dir:?}/$1"
  local eval_every=$(( $4 / 10 ))
  "$stoke" train --quiet "${model[@]}" "${common[@]}" --set run.name="$1" --set train.optimizer="$2" \
    --set train.grad_accum="$3" --set train.steps="$4" --set train.lr="$5" --set train.min_lr="$6" \
    --set eval.every="$eval_every" | grep -E "^(done|interrupted)" || true
}
quarter=$(( steps / 4 ))
run adamw-1x adamw 1 "$steps" 0.002 0.0002
run lamb-4x lamb 4 "$quarter" "$lamb_lr" "$(awk "BEGIN { print $lamb_lr / 10 }")"
run adamw-4x adamw 4 "$quarter" 0.002 0.0002
for b in lamb-4x adamw-4x; do
  echo "== adamw-1x vs $b"
  "$stoke" compare adamw-1x "$b" --runs "$dir" --tolerance 0.03 || true
done
