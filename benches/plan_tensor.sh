#!/usr/bin/env bash
# The planner against measured tensor-, pipeline- and data-parallel runs on this machine.
#
# Trains shapes of the gpt family on one process (layout 1,1,1), cut over two processes (tensor
# parallelism, 2,1,1), in two pipeline stages (1F1B, 1,2,1, 4 or 8 micro-batches; two held-out
# shapes interleaved, 2 chunks a stage) and as two
# data-parallel copies (1,1,2), ROUNDS times each (default 3), one
# libtorch thread per process, fp32, under the real-time FIFO scheduler when allowed (`chrt -f`,
# see plan_calibration.sh for why). Then `stoke plan --calibrate` fits this machine's efficiencies
# on the CALIBRATION runs (every single-process shape, and some cut and data-parallel ones) and
# predicts the HELD_OUT runs, cut and data-parallel shapes the fit never saw, at the median step
# time of their rounds. Two cores hold at most two processes, so layouts of four ranks are left out.
#
# Usage: benches/plan_tensor.sh                 # train, calibrate, compare (about 10 minutes)
#        SKIP_TRAIN=1 benches/plan_tensor.sh    # reuse the runs/plan-tp-* already there
#
# Figures: benches/RESULTS.md, "Planner", the tensor-parallel table.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}
ROUNDS=${ROUNDS:-3}
PREFIX=plan-tp
# shellcheck source=benches/plan_runs.sh
source benches/plan_runs.sh

# name layout overrides...
train() {
    local name=$1 layout=$2
    shift 2
    rm -rf "runs/$name"
    "${PRIORITY[@]}" "$STOKE" launch --layout "$layout" -- train --quiet \
        --set run.name="\"$name\"" --set run.device='"cpu"' --set train.steps="$STEPS" --set train.threads=1 \
        --set train.precision='"fp32"' --set ckpt.every=0 --set ckpt.at_end=false --set prof.prometheus=false "$@" \
        >/dev/null
}

# Each entry: name, layout, then --set overrides. Widths are 64 per head, heads even (the cut takes
# whole heads).
CALIBRATION=(
    "$PREFIX-a 1,1,1 model.n_layer=2 train.micro_batch=16"
    "$PREFIX-b 1,1,1 model.n_layer=4 train.micro_batch=8"
    "$PREFIX-c 1,1,1 model.n_layer=4 train.micro_batch=4 train.grad_accum=2"
    "$PREFIX-d 1,1,1 model.n_layer=6 model.d_model=384 model.n_head=6 train.micro_batch=8"
    "$PREFIX-e 1,1,1 model.n_layer=2 model.d_model=512 model.n_head=8 train.micro_batch=8"
    "$PREFIX-f 1,1,1 model.n_layer=8 model.d_model=128 model.n_head=2 train.micro_batch=16"
    "$PREFIX-g 1,1,1 model.n_layer=3 model.d_model=384 model.n_head=6 train.micro_batch=16"
    "$PREFIX-h 1,1,1 model.n_layer=4 model.d_model=512 model.n_head=8 train.micro_batch=4"
    "$PREFIX-ta 2,1,1 model.n_layer=2 train.micro_batch=16"
    "$PREFIX-td 2,1,1 model.n_layer=6 model.d_model=384 model.n_head=6 train.micro_batch=8"
    "$PREFIX-tf 2,1,1 model.n_layer=8 model.d_model=128 model.n_head=2 train.micro_batch=16"
    "$PREFIX-db 1,1,2 model.n_layer=4 train.micro_batch=8"
    "$PREFIX-de 1,1,2 model.n_layer=2 model.d_model=512 model.n_head=8 train.micro_batch=8"
    "$PREFIX-pb 1,2,1 model.n_layer=4 train.micro_batch=2 train.grad_accum=4"
    "$PREFIX-pf 1,2,1 model.n_layer=8 model.d_model=128 model.n_head=2 train.micro_batch=4 train.grad_accum=4"
)
HELD_OUT=(
    "$PREFIX-tb 2,1,1 model.n_layer=4 train.micro_batch=8"
    "$PREFIX-te 2,1,1 model.n_layer=2 model.d_model=512 model.n_head=8 train.micro_batch=8"
    "$PREFIX-tg 2,1,1 model.n_layer=3 model.d_model=384 model.n_head=6 train.micro_batch=16"
    "$PREFIX-th 2,1,1 model.n_layer=4 model.d_model=512 model.n_head=8 train.micro_batch=4"
    "$PREFIX-tc 2,1,1 model.n_layer=4 train.micro_batch=4 train.grad_accum=2"
    "$PREFIX-dd 1,1,2 model.n_layer=6 model.d_model=384 model.n_head=6 train.micro_batch=8"
    "$PREFIX-dg 1,1,2 model.n_layer=3 model.d_model=384 model.n_head=6 train.micro_batch=16"
    "$PREFIX-pd 1,2,1 model.n_layer=6 model.d_model=384 model.n_head=6 train.micro_batch=2 train.grad_accum=4"
    "$PREFIX-ph 1,2,1 model.n_layer=4 model.d_model=512 model.n_head=8 train.micro_batch=1 train.grad_accum=8"
    "$PREFIX-ib 1,2,1 model.n_layer=4 train.micro_batch=2 train.grad_accum=4 dist.pipeline_schedule=\"interleaved\""
    "$PREFIX-if 1,2,1 model.n_layer=8 model.d_model=128 model.n_head=2 train.micro_batch=4 train.grad_accum=4 dist.pipeline_schedule=\"interleaved\""
)

train_spec() {
    local round=$1 name layout overrides args=() kv
    read -r name layout overrides <<<"$2"
    for kv in $overrides; do
        args+=(--set "$kv")
    done
    train "$name-$round" "$layout" "${args[@]}"
}

if [ -z "${SKIP_TRAIN:-}" ]; then
    train_rounds
fi

# shellcheck disable=SC2046
"$STOKE" plan --cluster cpu --precision fp32 \
    --calibrate $(reports "${CALIBRATION[@]}") \
    --holdout $(reports "${HELD_OUT[@]}") \
    --merge-repeats --save "runs/$PREFIX-efficiency.json" "$@"
