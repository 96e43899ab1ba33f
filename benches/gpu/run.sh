#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU and PyTorch 2.11.0 installed (its
# libtorch and NVIDIA wheels are what the binaries load). Build the binaries on any machine first:
#
#   STOKE_LINK_TORCH_CUDA=1 CARGO_TARGET_DIR=target/gpu cargo build --release --bin stoke
#   CARGO_TARGET_DIR=target/gpu cargo build --release -p stoke-comm --features nccl --bin stoke-comm-worker
#   benches/gpu/run.sh target/gpu/release [out-dir]
#
# STOKE_LINK_TORCH_CUDA=1 links libtorch_cuda.so explicitly (the linker's --as-needed drops it
# otherwise, and libtorch then sees no GPU). Checks, each printed with its figures:
#   1. stoke-comm's nccl backend (benches/gpu/nccl_check.sh): every op, dtype and odd size.
#   2. bf16 training on the GPU for the tiny, small and gpt2-124m presets: median step, tokens/s, MFU.
#   3. The block executor against the single-graph step on the GPU (interleaved pairs).
#   4. Recomputation on the GPU: device memory at the step's peak and step time per policy.
#   5. fp16 with dynamic loss scaling against bf16 and fp32 on the built-in data.
#   6. AdamW, LAMB and SGD on the GPU with held-out evaluation (the optimizers' tensor-op path).
#   7. Checkpoints from the GPU: background (pinned host buffers) against synchronous saves, the step
#      stall of each and the pinned bytes.
#   8. A device per rank and GPU health: `stoke env`; one rank per GPU under `stoke launch` with the
#      NCCL backend (2 or more GPUs; each rank's device from its report, the job's tokens/s against
#      one GPU's), NVML's readings in report.json's `gpus` and in a `/metrics` scrape while training,
#      and more ranks than GPUs refused with the counts named.
#
# SECTIONS="2 3" runs only those checks (default: all).
set -uo pipefail
want() { [ -z "${SECTIONS:-}" ] || [[ " $SECTIONS " == *" $1 "* ]]; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$(cd "${1:-$ROOT/target/gpu/release}" && pwd)"
OUTDIR="${2:-${OUT:-$ROOT/runs/gpu}}"
mkdir -p "$OUTDIR"
RUNS="$(mktemp -d)"
PY="${PYTHON:-python3}"
TORCH="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || { echo "no PyTorch for $PY" >&2; exit 2; }
NV="$("$PY" -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in sorted(os.listdir(p)) if os.path.isdir(os.path.join(p, d, "lib"))))' 2>/dev/null || true)"
export LD_LIBRARY_PATH="$TORCH/lib${NV:+:$NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "torch: $TORCH ($("$PY" -c 'import torch; print(torch.__version__)'))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if ldd "$BIN/stoke" | grep -q 'libtorch_cuda.so => /'; then
  echo "stoke links libtorch_cuda: $(ldd "$BIN/stoke" | awk '/libtorch_cuda.so/ {print $3}')"
else
  echo "stoke does not link libtorch_cuda (build with STOKE_LINK_TORCH_CUDA=1)"; ldd "$BIN/stoke" | grep -i 'torch\|not found'
fi

if want 1; then echo "== 1. nccl backend"
if [ -x "$BIN/stoke-comm-worker" ]; then
  timeout 300 "$ROOT/benches/gpu/nccl_check.sh" "$BIN/stoke-comm-worker" 2>&1 | tail -20
else
  echo "skipped: no $BIN/stoke-comm-worker"
fi
fi

train() { # name, then --set overrides
  local name="$1"; shift
  local args=()
  for kv in "$@"; do args+=(--set "$kv"); done
  timeout 300 "$BIN/stoke" train --quiet --set run.dir="$RUNS" --set run.name="$name" --set run.device=cuda \
    --set ckpt.every=0 --set ckpt.at_end=false --set prof.prometheus=false --set prof.html=false \
    --set prof.trace=false --set prof.sync_every=1 "${args[@]}" > "$RUNS/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then echo "$name: exit $rc"; tail -5 "$RUNS/$name.log"; return $rc; fi
  "$PY" - "$RUNS/$name/report.json" "$RUNS/$name/metrics.jsonl" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
losses = [json.loads(l)["loss"] for l in open(sys.argv[2])]
tail = losses[-20:]
print(f"{sys.argv[3]:<28} step {r['step_ms']:8.2f} ms  {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.3f}  "
      f"peak mem {r['peak_memory_bytes'] / 2**30:6.2f} GiB  final loss (mean of last 20) {sum(tail) / len(tail):.4f}")
PY
  cp "$RUNS/$name/report.json" "$OUTDIR/$name.json" 2>/dev/null || true
}

if want 2; then echo "== 2. bf16 training per preset"
train tiny-bf16 model.preset=tiny train.precision=bf16 train.micro_batch=32 train.steps=80
train small-bf16 model.preset=small train.precision=bf16 train.micro_batch=32 train.steps=60
train gpt2-bf16 model.preset=gpt2-124m train.precision=bf16 train.micro_batch=16 train.steps=40
fi

if want 3; then echo "== 3. block executor vs single graph (gpt2-124m, bf16, interleaved)"
for pair in 1 2 3; do
  train "exec-blocks-$pair" model.preset=gpt2-124m train.micro_batch=16 train.steps=25 train.executor=blocks
  train "exec-graph-$pair" model.preset=gpt2-124m train.micro_batch=16 train.steps=25 train.executor=single-graph
done
"$PY" - "$RUNS" <<'PY'
import json, statistics, sys
d = sys.argv[1]
r = [json.load(open(f"{d}/exec-blocks-{i}/report.json"))["step_ms"] / json.load(open(f"{d}/exec-graph-{i}/report.json"))["step_ms"] for i in (1, 2, 3)]
print(f"blocks / single-graph step time: median {statistics.median(r):.3f} [min {min(r):.3f}, max {max(r):.3f}]")
PY
fi

if want 4; then echo "== 4. recomputation (gpt2-124m, bf16, micro-batch 16)"
for policy in none mlp attention block; do
  train "recompute-$policy" model.preset=gpt2-124m train.micro_batch=16 train.steps=20 train.recompute=$policy
done
fi

if want 5; then echo "== 5. fp16 with loss scaling vs bf16 and fp32 (small, 300 steps)"
for precision in fp32 bf16 fp16; do
  train "precision-$precision" model.preset=small train.precision=$precision train.micro_batch=32 train.steps=300
done
grep -h '"skipped_steps"\|"loss_scale"' "$RUNS/precision-fp16/report.json" || true
fi

if want 6; then echo "== 6. optimizers and guardrails on the GPU (small, bf16, 200 steps, evaluation every 50)"
for optimizer in adamw lamb sgd; do
  lr=0.002; [ $optimizer = lamb ] && lr=0.005; [ $optimizer = sgd ] && lr=0.05
  train "optim-$optimizer" model.preset=small train.optimizer=$optimizer train.lr=$lr train.micro_batch=32 \
    train.steps=200 eval.every=50
  grep -h '"eval_loss"' "$RUNS/optim-$optimizer/metrics.jsonl" | tail -1 | cut -c1-200 || true
done
fi
if want 7; then echo "== 7. checkpoints from the GPU (gpt2-124m, bf16, a checkpoint every 5 steps, interleaved)"
for pair in 1 2; do
  for mode in true false; do
    name="ckpt-bg$mode-$pair"
    timeout 300 "$BIN/stoke" train --quiet --set run.dir="$RUNS" --set run.name="$name" --set run.device=cuda \
      --set model.preset=gpt2-124m --set train.precision=bf16 --set train.micro_batch=16 --set train.steps=20 \
      --set ckpt.every=5 --set ckpt.at_end=false --set ckpt.background=$mode --set prof.prometheus=false \
      --set prof.html=false --set prof.trace=false > "$RUNS/$name.log" 2>&1 || { echo "$name failed"; tail -5 "$RUNS/$name.log"; continue; }
    "$PY" - "$RUNS/$name" "$name" <<'PY'
import json, statistics, sys
d, name = sys.argv[1], sys.argv[2]
stalls = [json.loads(l)["phases_ms"]["ckpt_stall"] for l in open(f"{d}/metrics.jsonl") if json.loads(l)["step"] % 5 == 0]
stats = json.load(open(f"{d}/checkpoint-stats.json"))
print(f"{name:<16} ckpt_stall per checkpoint {[round(s, 1) for s in stalls]} ms, median of the warm ones "
      f"{statistics.median(stalls[1:]):.1f} ms; writer: {json.dumps({k: v for k, v in stats.items() if k != 'resume'})[:300]}")
PY
  done
done
fi
if want 8; then echo "== 8. a device per rank, NCCL data parallelism, GPU health (gpt2-124m, bf16)"
"$BIN/stoke" env || echo "stoke env failed"
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
train health-1gpu model.preset=gpt2-124m train.precision=bf16 train.micro_batch=16 train.steps=30
"$PY" - "$RUNS/health-1gpu/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("gpus in report.json:", json.dumps(r.get("gpus"))[:400], "| gpu_health_error:", r.get("gpu_health_error"))
PY
PORT=$((30000 + RANDOM % 20000))
timeout 300 "$BIN/stoke" train --quiet --set run.dir="$RUNS" --set run.name=health-scrape --set run.device=cuda \
  --set model.preset=gpt2-124m --set train.steps=60 --set ckpt.every=0 --set ckpt.at_end=false \
  --set prof.prometheus_port=$PORT > "$RUNS/health-scrape.log" 2>&1 &
scrape_pid=$!
for _ in $(seq 1 60); do
  sleep 2
  if curl -s "http://127.0.0.1:$PORT/metrics" | grep '^stoke_gpu' | head -8 > "$RUNS/scrape.txt" && [ -s "$RUNS/scrape.txt" ]; then break; fi
done
echo "/metrics while training:"; cat "$RUNS/scrape.txt" 2>/dev/null || echo "no stoke_gpu series scraped"
wait "$scrape_pid" || echo "scrape run failed: $(tail -3 "$RUNS/health-scrape.log")"
if [ "${GPUS:-0}" -ge 2 ]; then
  timeout 600 "$BIN/stoke" launch --nproc "$GPUS" -- train --quiet --set run.dir="$RUNS" --set run.name=dp-nccl \
    --set run.device=cuda --set dist.backend='"nccl"' --set model.preset=gpt2-124m --set train.precision=bf16 \
    --set train.micro_batch=16 --set train.steps=40 --set ckpt.every=0 --set ckpt.at_end=false \
    > "$RUNS/dp-nccl.log" 2>&1 || { echo "dp-nccl failed"; tail -10 "$RUNS/dp-nccl.log"; }
  "$PY" - "$RUNS/dp-nccl/report.json" "$RUNS/health-1gpu/report.json" "$GPUS" <<'PY'
import json, sys
dp, one, n = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
print(f"{n} GPUs over NCCL: job {dp['tokens_per_s']:.0f} tok/s, rank 0 {dp['rank0']['tokens_per_s']:.0f}; one GPU "
      f"{one['tokens_per_s']:.0f}: scaling {dp['tokens_per_s'] / (n * one['tokens_per_s']):.3f}")
PY
  timeout 120 "$BIN/stoke" launch --nproc $((GPUS + 1)) -- train --quiet --set run.dir="$RUNS" \
    --set run.name=too-many --set run.device=cuda --set train.steps=2 > "$RUNS/too-many.log" 2>&1
  echo "more ranks than GPUs: exit $? | $(grep -m1 'one device per rank' "$RUNS/too-many.log")"
else
  echo "one GPU: data parallelism over NCCL needs two or more"
fi
cp "$RUNS"/*.log "$OUTDIR/" 2>/dev/null || true
fi
rm -rf "$RUNS"
