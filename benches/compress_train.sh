#!/usr/bin/env bash
# Compressed gradients on real training runs (reference: int8 exposes at least 30% less): exposed communication (the step report's
# `comm_exposed` phase) of `dist.compress = "int8"` against "none", per transport, on 2 processes, at
# ZeRO stage 0 (gradients all-reduced: everything the step sends is gradients) and stage 2
# (gradients reduce-scattered; the parameters' all-gather after the update, fp32 in both variants,
# is exposed communication too); int8 with error feedback, block 256.
#
# Transports:
#   shm       stoke's shared-memory backend (`stoke launch --nproc 2`): a transfer is a memcpy;
#   mpi-tcp   Open MPI restricted to its TCP transport on loopback (`mpirun --mca pml ob1 --mca btl
#             tcp,self --mca btl_tcp_if_include lo`, `dist.backend = "mpi"`): a stand-in for a network
#             link between machines (the bytes go through the kernel's TCP stack, not a wire).
# Each pair runs every transport and variant once, interleaved; each run's figure is the median over
# its measured steps (report.json's `ranks.ranks[*]`), averaged over the 2 ranks; the table gives the
# median of the pairs with min and max. Gradient bytes on the wire per step and rank are the formula's
# (`compress_bench` counts them on a real exchange: its "wire bytes" column): a reduce-scatter sends
# (n - 1) / n x 4 bytes per parameter in fp32 and (n - 1) / n x (1 + 4 / block) in int8, an
# all-reduce twice that (a ring's two phases; int8's reduce-scatter and all-gather). At stage 2 the
# parameters' all-gather adds (n - 1) / n x 4 bytes per parameter to both.
# Then `compress_bench` on both transports: the codec's GB/s against memcpy in one run, and one 25 MiB
# all-reduce per variant.
#
#   benches/compress_train.sh [steps] [pairs]        # defaults: 12 steps, 3 pairs
#
# Environment: STOKE (default target/release/stoke; must be built with `--features stoke-comm/mpi`),
# BENCH (default target/release/examples/compress_bench, same feature), BASELINE (another stoke
# binary, e.g. an older commit's: its int8 runs as a third variant), BASELINE_BENCH and BENCH_PAIRS
# (below), TRANSPORTS (default "shm
# mpi-tcp"), STAGES (default "0 2"), LAYERS / WIDTH / HEADS / MICRO_BATCH (default 8 / 512 / 8 / 2:
# 25.4 M parameters, 2 x 128 tokens per process and step).
# Measured processes run under `chrt -f 10` when allowed. Needs Open MPI (`mpirun`; `cargo xtask
# test` installs it) and:
#   cargo build --release --features stoke-comm/mpi --bin stoke
#   cargo build --release --features stoke-comm/mpi -p stoke-train --example compress_bench
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
pairs=${2:-3}
stoke=${STOKE:-target/release/stoke}
bench=${BENCH:-target/release/examples/compress_bench}
transports=${TRANSPORTS:-"shm mpi-tcp"}
stages=${STAGES:-"0 2"}
layers=${LAYERS:-8} width=${WIDTH:-512} heads=${HEADS:-8} micro_batch=${MICRO_BATCH:-2}
block=256
prio=()
if chrt -f 10 true 2>/dev/null; then prio=(chrt -f 10); fi
dir=runs/compress_train
rm -rf "$dir" && mkdir -p "$dir/ompi"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
root=()
# Open MPI refuses root unless told (CI containers run as root).
if [ "$(id -u)" = 0 ]; then root=(--allow-run-as-root); fi
# Open MPI's session folder inside the run folder (its default in the temp folder is created racily).
export OMPI_MCA_orte_tmpdir_base="$PWD/$dir/ompi"
mpi_tcp=(mpirun -np 2 --oversubscribe "${root[@]}" --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo)

common=(--quiet --data "$dir/corpus.txt" --set run.dir="\"$dir\"" --set train.steps="$steps" --set train.threads=1
  --set train.micro_batch="$micro_batch" --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false
  --set model.n_layer="$layers" --set model.d_model="$width" --set model.n_head="$heads"
  --set prof.prometheus=false --set train.monitor_every=0 --set dist.compress_block="$block")

run() { # transport stage variant binary name
  local transport=$1 stage=$2 variant=$3 binary=$4 name=$5 compress=$3
  [ "$compress" = int8-baseline ] && compress=int8
  local args=("${common[@]}" --set run.name="\"$name\"" --set dist.zero="$stage" --set dist.compress="\"$compress\"")
  case $transport in
    shm) timeout 900 "${prio[@]}" "$binary" launch --nproc 2 -- train "${args[@]}" >"$dir/$name.log" 2>&1 ;;
    mpi-tcp) timeout 900 "${prio[@]}" "${mpi_tcp[@]}" "$binary" train "${args[@]}" --set dist.backend='"mpi"' \
      >"$dir/$name.log" 2>&1 ;;
  esac || { echo "compress_train: $name failed; its log:" >&2; tail -20 "$dir/$name.log" >&2; exit 1; }
  python3 - "$dir/$name/report.json" "$transport" "$stage" "$variant" "$pair" <<'EOF' | tee -a "$dir/runs.jsonl" >&2
import json, sys
path, transport, stage, variant, pair = sys.argv[1:]
report = json.load(open(path))
ranks = report["ranks"]["ranks"]
mean = lambda f: sum(f(r) for r in ranks) / len(ranks)
print(json.dumps({"transport": transport, "stage": int(stage), "variant": variant, "pair": int(pair), "n_ranks": len(ranks),
                  "n_params": report["model"]["n_params"],
                  "comm_exposed_ms": mean(lambda r: r["comm_exposed_ms"]),
                  "comm_total_ms": mean(lambda r: r["comm_total_ms"]),
                  "backward_ms": mean(lambda r: r["phases"].get("backward", 0.0)),
                  "step_ms": mean(lambda r: r["step_ms"])}))
EOF
}

echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); $(mpirun --version | head -1)"
echo "stoke: $stoke${BASELINE:+; baseline: $BASELINE}; $layers layers, width $width, micro-batch $micro_batch, $steps steps, 2 processes"
: >"$dir/runs.jsonl"
for pair in $(seq 1 "$pairs"); do
  for transport in $transports; do
    for stage in $stages; do
      run "$transport" "$stage" none "$stoke" "$transport-zero$stage-none-p$pair"
      run "$transport" "$stage" int8 "$stoke" "$transport-zero$stage-int8-p$pair"
      if [ -n "${BASELINE:-}" ]; then
        run "$transport" "$stage" int8-baseline "$BASELINE" "$transport-zero$stage-int8-baseline-p$pair"
      fi
    done
  done
done
echo "load average after the training runs: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$dir/runs.jsonl" "$block" <<'EOF'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
block = int(sys.argv[2])
def mmm(values):
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"
print()
print("| transport | ZeRO | variant | gradient bytes on the wire per step and rank (formula) | comm_exposed ms | "
      "exposed / none (median of pairs) | backward ms | step ms |")
print("|---|---|---|---|---|---|---|---|")
for transport, stage in dict.fromkeys((r["transport"], r["stage"]) for r in runs):
    mine = [r for r in runs if r["transport"] == transport and r["stage"] == stage]
    none = {r["pair"]: r for r in mine if r["variant"] == "none"}
    for variant in dict.fromkeys(r["variant"] for r in mine):
        rows = [r for r in mine if r["variant"] == variant]
        n, p = rows[0]["n_ranks"], rows[0]["n_params"]
        per_value = 4 if variant == "none" else 1 + 4 / block
        wire = (n - 1) / n * per_value * p * (2 if stage < 2 else 1)
        ratio = statistics.median(r["comm_exposed_ms"] / none[r["pair"]]["comm_exposed_ms"] for r in rows)
        print(f"| {transport} | {stage} | {variant} | {wire / 1e6:.1f} MB | {mmm([r['comm_exposed_ms'] for r in rows])} | "
              f"{ratio:.2f} | {mmm([r['backward_ms'] for r in rows])} | {mmm([r['step_ms'] for r in rows])} |")
EOF

# BASELINE_BENCH (another compress_bench binary, e.g. an older commit's; shm only, as older ones had no
# --backend) runs after each of this one's shm runs: pairs of interleaved runs.
for pair in $(seq 1 "${BENCH_PAIRS:-1}"); do
  echo
  echo "compress_bench, shm (2 processes, started by itself), run $pair:"
  timeout 900 "${prio[@]}" "$bench" --rounds 3 --iters 5 2>/dev/null
  if [ -n "${BASELINE_BENCH:-}" ]; then
    echo
    echo "baseline compress_bench ($BASELINE_BENCH), shm, run $pair:"
    timeout 900 "${prio[@]}" "$BASELINE_BENCH" --rounds 3 --iters 5 2>/dev/null
  fi
done
if [[ " $transports " == *" mpi-tcp "* ]]; then
  echo
  echo "compress_bench, Open MPI over TCP on loopback:"
  timeout 900 "${prio[@]}" "${mpi_tcp[@]}" "$bench" --backend mpi --rounds 3 --iters 5 2>/dev/null
fi
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
