#!/usr/bin/env bash
# Large-batch training: LAMB at 4x the batch with the linearly scaled learning rate
# against AdamW at the base batch, and AdamW at 4x with the same rule, on the built-in corpus.
# AdamW at the base batch runs base_steps; the 4x runs may take up to cap x its tokens (their
# cosine schedules span the whole cap), since reaching the same loss does not require the same
# tokens. Every run evaluates on the corpus's held-out tail every base_steps / 10 base-batch steps'
# worth of tokens (the same token grid for all three); `stoke compare` lines the curves up by
# tokens seen and prints the final evaluation losses and where each run first reached AdamW-at-
# base's final evaluation loss (+3%): tokens and seconds of step time (the sum of the runs' step
# times, so time spent evaluating is not counted, and the median step time x steps).
#
# LAMB moves each adapted tensor by lr x its norm per step, a different scale from AdamW's, so its
# reference rate (at the base batch, before the rule's 4x) is its own: lamb_lr (0.0075 was the best
# of 0.0025, 0.0035, 0.005, 0.0075 and 0.01 measured on 2026-12-01, tied with 0.01).
# Current figures: benches/RESULTS.md, "Large batches".
#
#   benches/lamb_batch.sh [base_steps] [binary] [lamb_lr] [runs] [cap]
#       (defaults: 600 target/release/stoke 0.0075 "adamw-1x lamb-4x adamw-4x" 2)
# Extra `--set` overrides for the LAMB run go in LAMB_SET (e.g. LAMB_SET="train.eps=1e-6"), for
# every run in STOKE_SET (e.g. STOKE_SET="train.threads=1" on a shared machine); LAMB_DIR sets
# the runs' folder; LAMB_MULT the batch multiple of the large-batch runs (default 4: "lamb-4x",
# "adamw-4x"; their evaluations every base_steps / 10 / LAMB_MULT steps, rounded); LAMB_PARALLEL=1 runs the three at once (each then sees the same machine load,
# which makes their step times comparable on a shared machine; use it with train.threads=1).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-600}
stoke=${2:-target/release/stoke}
lamb_lr=${3:-0.0075}
mult=${LAMB_MULT:-4}
runs=${4:-adamw-1x lamb-${mult}x adamw-${mult}x}
cap=${5:-2}
dir=${LAMB_DIR:-runs/bench-lamb-batch}
mkdir -p "$dir"
model=(--set model.n_layer=2 --set model.d_model=128 --set model.n_head=4 --set model.seq_len=64)
common=(--set run.dir="$dir" --set train.micro_batch=16 --set train.lr_reference_batch=16
  --set train.lr_scaling=linear --set train.warmup_steps=30 --set eval.batches=8 --set ckpt.every=0
  --set ckpt.at_end=false --set prof.prometheus=false)
lamb_extra=()
for kv in ${LAMB_SET:-}; do lamb_extra+=(--set "$kv"); done
for kv in ${STOKE_SET:-}; do common+=(--set "$kv"); done
run() { # name optimizer grad_accum steps eval_every lr min_lr [extra --set ...]
  [[ " $runs " == *" $1 "* ]] || return 0
  rm -rf "${dir:?}/$1"
  local cmd=("$stoke" train --quiet "${model[@]}" "${common[@]}" --set run.name="$1" --set train.optimizer="$2"
    --set train.grad_accum="$3" --set train.steps="$4" --set eval.every="$5" --set train.lr="$6"
    --set train.min_lr="$7" "${@:8}")
  if [[ "${LAMB_PARALLEL:-0}" == 1 ]]; then
    { "${cmd[@]}" | grep -E "^(done|interrupted)" || true; } &
  else
    "${cmd[@]}" | grep -E "^(done|interrupted)" || true
  fi
}
eval_every=$(( steps / 10 ))
big_steps=$(awk "BEGIN { print int($steps * $cap / $mult) }")
big_eval=$(( (eval_every + mult / 2) / mult ))
(( big_eval > 0 )) || big_eval=1
run adamw-1x adamw 1 "$steps" "$eval_every" 0.002 0.0002
run "lamb-${mult}x" lamb "$mult" "$big_steps" "$big_eval" "$lamb_lr" "$(awk "BEGIN { print $lamb_lr / 10 }")" \
  "${lamb_extra[@]}"
run "adamw-${mult}x" adamw "$mult" "$big_steps" "$big_eval" 0.002 0.0002
wait
for b in "lamb-${mult}x" "adamw-${mult}x"; do
  echo "== adamw-1x vs $b"
  "$stoke" compare adamw-1x "$b" --runs "$dir" --tolerance 0.03 || true
done
