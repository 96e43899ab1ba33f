#!/usr/bin/env bash
# The ZeRO benchmarks, interleaved in one run (each pair runs every variant once):
#
#   memory    per-rank peak resident set of `stoke launch --nproc W -- train --set dist.zero=S` for S in
#             0..3 and W in 2, 4, against the formula (`stoke plan --zero-table`, the function the run's
#             report.json also prints): the bytes each stage saves against stage 0 in the same pair,
#             measured over predicted (target within 5%); and report.json's per-rank bytes, which must
#             equal the formula's;
#   time      step time of stages 1-3 over stage 0 (target: stage 3 with prefetch at most 1.15 on 2
#             processes);
#   peer      PyTorch FSDP (gloo, FULL_SHARD and SHARD_GRAD_OP, each block a unit; benches/peers/fsdp_gpt.py)
#             on the same model, rows and processes: step time and per-rank peak memory, and the model
#             states FSDP holds counted from its tensors; FSDP1 and FSDP2 (`fully_shard` with
#             MixedPrecisionPolicy: bf16 parameters and reductions) side by side (FSDP_APIS).
#
# The model: 12 blocks of width 512 (about 38 M parameters, 16 bytes each at stage 0 with AdamW: ~600 MiB
# per rank), 2 rows of 128 tokens per process, so model states dominate each rank's memory.
# The machine's limits (`stoke bench limits`: matmul peak, memcpy) and its memory are printed first.
#
#   benches/zero.sh [steps] [pairs]      # defaults: 20 steps, 3 pairs
#
# Environment: MICRO_BATCH (rows per process, default 2; more rows make the step's compute larger
# against the gathers, which do not grow with it), WORLDS (default "2 4"), STAGES (default "0 1 2 3"), PARTS (default "stoke peer": which
# halves run), RECOMPUTE (train.recompute, default none), PREFETCH (dist.prefetch_blocks, default 1),
# GRAD_UNITS (dist.gradient_units: full gradients alive at once at stages 2 and 3, the run's bound and the
# formula's, default 2), STOKE (the
# binary, default target/release/stoke), SLICES (the formula's optimizer slices: mapped, what the fused CPU
# optimizer does, the default; or copied), FSDP_FORWARD_PREFETCH=1 (FSDP's forward_prefetch; its default,
# off, keeps only its backward prefetch), FSDP_APIS (default "fsdp1 fsdp2").
# Needs a release build (cargo build --release --bin stoke) and `cargo xtask peers` (torch 2.11.0).
#
# Current figures on the development machine: benches/RESULTS.md, "ZeRO against FSDP".
set -euo pipefail
# Its own scheduling group at nice -20 when allowed (see benches/dp_scaling.sh).
if [ -z "${ZERO_SETSID:-}" ] && command -v setsid >/dev/null; then
  ZERO_SETSID=1 exec setsid -w "$0" "$@"
fi
echo -20 >"/proc/$$/autogroup" 2>/dev/null || echo "zero: cannot raise this group's priority; figures share the cores" >&2
cd "$(dirname "$0")/.."
steps=${1:-20}
pairs=${2:-3}
worlds=${WORLDS:-"2 4"}
stages=${STAGES:-"0 1 2 3"}
parts=${PARTS:-"stoke peer"}
recompute=${RECOMPUTE:-none}
prefetch=${PREFETCH:-1}
grad_units=${GRAD_UNITS:-2}
slices=${SLICES:-mapped}
py=.stoke/venv/bin/python
stoke=${STOKE:-target/release/stoke}
layers=12 width=512 heads=8 micro_batch=${MICRO_BATCH:-2}
dir=runs/zero
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.11.0') else 1)" \
  || { echo "zero: the peer needs torch 2.11.0 (cargo xtask peers)" >&2; exit 1; }
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); $(grep MemTotal /proc/meminfo)"
"$stoke" bench limits --dir "$dir/limits" | grep -E "matmul|memcpy"

# The formula, per world: at stage 3 the embedding (the tied head's weights) and 1 + prefetch more units
# are gathered at once.
gathered=$((1 + prefetch))
formulas=()
for world in $worlds; do
  "$stoke" plan --zero-table --json --model tiny --layers "$layers" --hidden "$width" --heads "$heads" \
    --devices "$world" --optimizer adamw --zero-slices "$slices" --zero-gradient-units "$grad_units" \
    --zero-gathered-units "$gathered" \
    >"$dir/formula-$world.json"
  formulas+=("$dir/formula-$world.json")
done

common=(--quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set train.steps="$steps" --set train.threads=1
  --set train.micro_batch="$micro_batch" --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false
  --set model.n_layer="$layers" --set model.d_model="$width" --set model.n_head="$heads"
  --set train.recompute="$recompute" --set dist.prefetch_blocks="$prefetch" --set dist.gradient_units="$grad_units"
  --set prof.prometheus=false
  --set train.monitor_every=0)
# train.monitor_every=0: the per-block monitors copy the parameters (on unsharded runs only), which
# would add to stage 0's peak and step alone.
# The same host-memory policy on both sides: what stoke's default `train.host_memory = "retain"` sets
# (stoke_train::retain_env), given to the peer through glibc's environment.
retain=(MALLOC_MMAP_MAX_=0 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=67108864)
fsdp() { # world sharding api -> the peer's JSON line
  (cd benches/peers && timeout 900 env "${retain[@]}" "../../$py" fsdp_gpt.py --data "../../$dir/corpus.txt" --nproc "$1" \
    --steps "$steps" --micro-batch "$micro_batch" --n-layer "$layers" --d-model "$width" --n-head "$heads" \
    --sharding "$2" --api "$3" ${FSDP_FORWARD_PREFETCH:+--forward-prefetch})
}
runs="$dir/runs.jsonl"
: >"$runs"
for pair in $(seq 1 "$pairs"); do
  for world in $worlds; do
    if [[ " $parts " == *" stoke "* ]]; then
      for stage in $stages; do
        name="zero$stage-w$world-p$pair"
        "$stoke" launch --nproc "$world" -- train "${common[@]}" --set run.name="$name" --set dist.zero="$stage" >/dev/null
        python3 benches/zero_report.py stoke "$dir/$name/report.json" "$world" "$stage" "$pair" | tee -a "$runs" |
          python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(f'pair {d[\"pair\"]}: stoke zero{d[\"stage\"]} x{d[\"world\"]}: {d[\"step_ms\"]:.1f} ms, peak RSS', [r['peak_rss_bytes'] >> 20 for r in d['ranks']], 'MiB')" >&2
      done
    fi
    if [[ " $parts " == *" peer "* ]]; then
      for api in ${FSDP_APIS:-fsdp1 fsdp2}; do
      for sharding in full_shard shard_grad_op; do
        line=$(fsdp "$world" "$sharding" "$api") || {
          echo "zero: the FSDP peer ($api $sharding, $world processes) failed; running it once more" >&2
          line=$(fsdp "$world" "$sharding" "$api")
        }
        python3 benches/zero_report.py peer "$world" "$sharding" "$pair" <<<"$line" | tee -a "$runs" |
          python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(f'pair {d[\"pair\"]}: {d[\"variant\"]} x{d[\"world\"]}: {d[\"step_ms\"]:.1f} ms, peak RSS', [r['peak_rss_bytes'] >> 20 for r in d['ranks']], 'MiB')" >&2
      done
      done
    fi
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 benches/zero_report.py table "$runs" "${formulas[@]}"
