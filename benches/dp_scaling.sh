#!/usr/bin/env bash
# The data-parallel benchmarks, interleaved in one run (each pair runs every variant once):
#
#   scaling   tokens/s of `stoke launch --nproc 2` (2 processes x 1 thread, the global batch twice
#             one process's) against twice the tokens/s of one 1-thread `stoke train`;
#   overlap   on a model whose gradients take a while to reduce but less than its backward (12 layers
#             of width 512, 2 rows per process, a bucket per block), 2 processes with overlap on
#             against dist.overlap=false (nothing sent before backward ends):
#             hidden = 1 - comm_exposed(overlap on) / comm_exposed(overlap off), and the step times;
#   peer      PyTorch DDP (gloo, 2 processes x 1 thread, the same GPT from benches/peers/train_gpt.py,
#             the attention that is fastest here, fused AdamW), eager and torch.compile:
#             stoke tokens/s / DDP tokens/s (DDP's compile time printed apart).
#
# Per pair it prints every figure; at the end the median, min and max of each per-pair ratio.
# The machine's limits (`stoke bench limits`: matmul peak, memcpy) are measured first, in the same run.
#
#   benches/dp_scaling.sh [steps] [pairs]      # defaults: 40 steps, 3 pairs
# Needs a release build (cargo build --release --bin stoke) and `cargo xtask peers` (torch 2.11.0).
set -euo pipefail
# As quiet as a shared machine allows: the run restarts itself under setsid, so it has its own scheduling
# group (Linux autogroup), which gets nice -20 when allowed: its processes take the cores before other
# groups' while the kernel still time-slices among them (a communication thread gets a core at once when
# it wakes; real-time FIFO priority would leave it waiting behind its own rank's compute thread until
# backward ends).
if [ -z "${DP_SCALING_SETSID:-}" ] && command -v setsid >/dev/null; then
  DP_SCALING_SETSID=1 exec setsid -w "$0" "$@"
fi
echo -20 >"/proc/$$/autogroup" 2>/dev/null || echo "dp_scaling: cannot raise this group's priority; figures share the cores" >&2
cd "$(dirname "$0")/.."
steps=${1:-40}
pairs=${2:-3}
py=.stoke/venv/bin/python
stoke=target/release/stoke
# Per process: 16 rows of 128 tokens (the tiny preset), bf16, one libtorch thread, no loader thread;
# buckets of BUCKET_MB (default 1: a bucket per block of this 12.8 MB model) for stoke and DDP alike.
micro_batch=16
bucket_mb=${BUCKET_MB:-1}
dir=runs/dp-scaling
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.11.0') else 1)" \
  || { echo "dp_scaling: the peer needs torch 2.11.0 (cargo xtask peers)" >&2; exit 1; }
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); scheduling group: $(cat /proc/$$/autogroup 2>/dev/null)"
"$stoke" bench limits --dir "$dir/limits" | grep -E "matmul|memcpy"
common=(--quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set train.steps="$steps" --set train.threads=1
  --set train.micro_batch="$micro_batch" --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false
  --set prof.enabled=false --set dist.bucket_mb="$bucket_mb")
# The overlap runs: 12 layers of width 512 (about 38 M parameters, 151 MB of gradients), 2 rows per process.
overlap_model=(--set model.n_layer=12 --set model.d_model=512 --set model.n_head=8 --set train.micro_batch=2)

# metrics.jsonl -> "tokens_per_s step_ms comm_exposed_ms backward_ms comm_total_ms" (medians over the
# steps after the first 5; tokens/s of the global batch: world x rank 0's tokens / median step).
stats() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][5:]
world = int(sys.argv[2])
med = lambda xs: statistics.median(xs)
step = med([r["step_ms"] for r in rows])
print(world * rows[0]["tokens"] / (step / 1e3), step, med([r["phases_ms"]["comm_exposed"] for r in rows]),
      med([r["phases_ms"]["backward"] for r in rows]), med([r.get("comm_total_ms", 0.0) for r in rows]))
PY
}
peer() { # DDP eager or compiled -> "tokens_per_s step_ms compile_or_warmup_s"
  (cd benches/peers && "../../$py" ddp_gpt.py --data "../../$dir/corpus.txt" --nproc 2 --steps "$steps" \
    --micro-batch "$micro_batch" --bucket-mb "$bucket_mb" "$@") |
    python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['tokens_per_s'], d['step_ms'], d.get('compile_s', d.get('warmup_s')))"
}

results="$dir/pairs.txt"
: >"$results"
for pair in $(seq 1 "$pairs"); do
  "$stoke" train "${common[@]}" --set run.name="one-$pair" >/dev/null
  read -r one_tps one_ms _ <<<"$(stats "$dir/one-$pair/metrics.jsonl" 1)"
  "$stoke" launch --nproc 2 -- train "${common[@]}" --set run.name="on-$pair" >/dev/null
  read -r on_tps on_ms _ <<<"$(stats "$dir/on-$pair/metrics.jsonl" 2)"
  "$stoke" launch --nproc 2 -- train "${common[@]}" "${overlap_model[@]}" --set run.name="ovon-$pair" >/dev/null
  read -r _ ovon_ms on_exposed on_backward on_total <<<"$(stats "$dir/ovon-$pair/metrics.jsonl" 2)"
  "$stoke" launch --nproc 2 -- train "${common[@]}" "${overlap_model[@]}" --set run.name="ovoff-$pair" \
    --set dist.overlap=false >/dev/null
  read -r _ off_ms off_exposed off_backward _ <<<"$(stats "$dir/ovoff-$pair/metrics.jsonl" 2)"
  read -r ddp_tps ddp_ms _ <<<"$(peer)"
  read -r ddpc_tps ddpc_ms ddpc_compile <<<"$(peer --compile)"
  python3 - "$pair" "$one_tps" "$one_ms" "$on_tps" "$on_ms" "$ovon_ms" "$on_exposed" "$on_backward" "$on_total" \
    "$off_ms" "$off_exposed" "$off_backward" "$ddp_tps" "$ddp_ms" "$ddpc_tps" "$ddpc_ms" "$ddpc_compile" <<'PY' | tee -a "$results"
import sys
p = sys.argv[1]
(one_tps, one_ms, on_tps, on_ms, ovon_ms, on_exp, on_bwd, on_total, off_ms, off_exp, off_bwd, ddp_tps, ddp_ms, ddpc_tps,
 ddpc_ms, compile_s) = map(float, sys.argv[2:])
print(f"pair {p}: 1 proc {one_tps:.0f} tok/s ({one_ms:.1f} ms) | 2 procs {on_tps:.0f} tok/s ({on_ms:.1f} ms) | "
      f"overlap model: on {ovon_ms:.1f} ms (backward {on_bwd:.1f}, comm exposed {on_exp:.2f}, comm total {on_total:.1f}), "
      f"off {off_ms:.1f} ms (backward {off_bwd:.1f}, comm exposed {off_exp:.2f}) | DDP eager {ddp_tps:.0f} tok/s "
      f"({ddp_ms:.1f} ms) | DDP compiled {ddpc_tps:.0f} tok/s ({ddpc_ms:.1f} ms, compile {compile_s:.1f} s)", file=sys.stderr)
hidden = 1 - on_exp / off_exp if off_exp > 0 else float("nan")
print(f"RATIOS scaling={on_tps / (2 * one_tps):.4f} hidden={hidden:.4f} on_over_off_step={ovon_ms / off_ms:.4f} "
      f"stoke_over_ddp={on_tps / ddp_tps:.4f} stoke_over_ddp_compiled={on_tps / ddpc_tps:.4f} "
      f"ddp_scaling={ddp_tps / (2 * one_tps):.4f} exposed_on_ms={on_exp:.3f} exposed_off_ms={off_exp:.3f} "
      f"compile_s={compile_s:.1f}")
PY
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import statistics, sys
pairs = [dict(kv.split("=") for kv in l.split()[1:]) for l in open(sys.argv[1]) if l.startswith("RATIOS")]
names = {
    "scaling": "2 procs x 1 thread / twice 1 proc (target >= 0.97)",
    "hidden": "comm hidden by overlap, 1 - exposed(on)/exposed(off) (target >= 0.80)",
    "on_over_off_step": "step time overlap on / off",
    "stoke_over_ddp": "stoke / PyTorch DDP eager tokens/s (target >= 1.0)",
    "stoke_over_ddp_compiled": "stoke / PyTorch DDP compiled tokens/s (target >= 1.0)",
    "ddp_scaling": "PyTorch DDP eager / twice 1-proc stoke (context)",
    "exposed_on_ms": "comm exposed per step, overlap on (ms)",
    "exposed_off_ms": "comm exposed per step, overlap off (ms): all of the communication",
    "compile_s": "DDP torch.compile time (s)",
}
print(f"\n{len(pairs)} interleaved pairs; median [min, max]:")
for key, label in names.items():
    v = [float(p[key]) for p in pairs]
    print(f"  {label}: {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
PY
