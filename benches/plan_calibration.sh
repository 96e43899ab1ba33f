#!/usr/bin/env bash
# Calibrates `stoke plan` on this machine and checks it on runs held out of the fit.
#
# Trains sixteen shapes of short runs (PRECISION, default fp32) on the CPU, ROUNDS times each
# (default 3), takes each shape's median step time (report.json's step_ms) over its rounds, fits
# the efficiencies on ten shapes, and prints predicted against measured step time for the other
# six (one of them the "small" preset, whose 256-token sequence no calibration shape has).
# Runs use one libtorch thread under the real-time FIFO scheduler (`chrt -f`, needs root; else
# `nice -n -10`, else plain): on the 2-core development machine, shared with other builds, a run at
# normal priority measured steps 2x slower and 3x more spread than the same run holding one core
# (the kernel still leaves the other core, and 5% of this one, to everyone else). Runs last seconds.
#
# Usage: benches/plan_calibration.sh              # train, calibrate, compare (about 15 minutes)
#        SKIP_TRAIN=1 benches/plan_calibration.sh  # reuse the runs/plan-cal-*-<round> already there
#        benches/plan_calibration.sh --json        # extra arguments go to `stoke plan`
#
# Current figures on the development machine: benches/RESULTS.md, "Planner". Use 3 rounds or more: one
# shape's step time moved by up to 45% between quiet and busy spells of the machine, and two rounds did not
# outvote a busy spell.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}
PRECISION=${PRECISION:-fp32}
# fp32 runs keep their historical names; other precisions get their own.
PREFIX=plan-cal
if [ "$PRECISION" != fp32 ]; then
    PREFIX=plan-cal-$PRECISION
fi
# shellcheck source=benches/plan_runs.sh
source benches/plan_runs.sh

train() {
    local name=$1
    shift
    rm -rf "runs/$name"
    "${PRIORITY[@]}" "$STOKE" train --quiet \
        --set run.name="$name" --set run.device=cpu --set train.steps="$STEPS" --set train.threads=1 \
        --set train.precision="$PRECISION" --set ckpt.every=0 --set ckpt.at_end=false "$@"
}

# Each shape: name, then --set overrides. Depth, width (64 per head), micro-batch and accumulation
# vary so that FLOPs, bytes and block passes move independently.
CALIBRATION=(
    "$PREFIX-a model.n_layer=2 train.micro_batch=16"
    "$PREFIX-b model.n_layer=4 train.micro_batch=8"
    "$PREFIX-c model.n_layer=4 train.micro_batch=4 train.grad_accum=2"
    "$PREFIX-d model.n_layer=6 model.d_model=384 model.n_head=6 train.micro_batch=8"
    "$PREFIX-e model.n_layer=2 model.d_model=512 model.n_head=8 train.micro_batch=8"
    "$PREFIX-f model.n_layer=8 model.d_model=128 model.n_head=2 train.micro_batch=16"
    "$PREFIX-j model.n_layer=3 model.d_model=192 model.n_head=3 train.micro_batch=8 train.grad_accum=2"
    "$PREFIX-k model.n_layer=5 model.d_model=320 model.n_head=5 train.micro_batch=4"
    "$PREFIX-l model.n_layer=1 train.micro_batch=32"
    "$PREFIX-m model.n_layer=4 model.d_model=128 model.n_head=2 train.micro_batch=8 train.grad_accum=4"
)
HELD_OUT=(
    "$PREFIX-g model.n_layer=4 model.d_model=384 model.n_head=6 train.micro_batch=16"
    "$PREFIX-h model.n_layer=3 train.micro_batch=4 train.grad_accum=4"
    "$PREFIX-i model.n_layer=6 train.micro_batch=16"
    "$PREFIX-n model.n_layer=2 model.d_model=448 model.n_head=7 train.micro_batch=8 train.grad_accum=2"
    "$PREFIX-o model.n_layer=5 model.d_model=192 model.n_head=3 train.micro_batch=16"
    "$PREFIX-p model.preset=small train.micro_batch=4"
)

ROUNDS=${ROUNDS:-3}

train_spec() {
    local round=$1 name overrides args=() kv
    read -r name overrides <<<"$2"
    for kv in $overrides; do
        args+=(--set "$kv")
    done
    train "$name-$round" "${args[@]}"
}

if [ -z "${SKIP_TRAIN:-}" ]; then
    train_rounds
fi

# shellcheck disable=SC2046
"$STOKE" plan --cluster cpu --precision "$PRECISION" \
    --calibrate $(reports "${CALIBRATION[@]}") \
    --holdout $(reports "${HELD_OUT[@]}") \
    --merge-repeats --save "runs/$PREFIX-efficiency.json" "$@"
