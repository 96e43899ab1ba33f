#!/usr/bin/env bash
# Tensor parallelism over 2 processes against PyTorch's, in interleaved rounds (stoke, peer, stoke, peer ...):
#
#   stoke   `stoke launch --nproc 2 -- train --set dist.tensor=2 --set model.family="gpt-rms"`: one copy of
#           the model cut Megatron-style over the 2 ranks (heads, MLP inner slice, vocabulary), shm
#           collectives, the built-in byte corpus;
#   peer    benches/peers/tp_gpt.py under `torchrun --nproc_per_node 2` (gloo): the same gpt-rms model cut by
#           torch.distributed.tensor.parallel (ColwiseParallel c_attn/c_fc, RowwiseParallel c_proj, the
#           vocabulary-parallel embedding and tied head with loss_parallel), fused AdamW, glibc keeping
#           freed memory, windows of the same corpus (`stoke corpus`).
#
# Both: fp32 on the CPU, 1 libtorch thread per rank, no loader thread, AdamW betas 0.9/0.95 with decay 0.1
# on matrices, warmup then cosine, clipping at 1.0, no checkpoints, no profiler. Step time: rank 0's median
# over the steps after the first SKIP (stoke's metrics.jsonl, the peer's own JSON line); tokens/s: one
# copy's tokens per step (micro_batch x seq_len) over it. Per round it prints both and the ratio
# stoke / peer of the median step times (below 1: stoke faster); at the end the median and [min, max] of
# each over the rounds.
#
#   benches/tensor_parallel.sh                      # ROUNDS=5 SIZE=small STEPS=30 SKIP=5
#   ROUNDS=3 SIZE=medium benches/tensor_parallel.sh
#   PEER_COMPILE=1 benches/tensor_parallel.sh       # the peer's blocks under torch.compile
#   SP=1 benches/tensor_parallel.sh                 # sequence parallelism on both sides: stoke's
#                                                   # dist.sequence_parallel, the peer's --sequence-parallel
#                                                   # (SequenceParallel norms, the sequence in pieces
#                                                   # between the branches)
#
# SIZE small: 4 layers, d_model 256, 8 heads, context 256, micro-batch 8, vocab 256 (bytes);
#      medium: 6 layers, d_model 512, 8 heads, context 256, micro-batch 8, vocab 256.
# Needs a release build (cargo build --release --bin stoke) and `cargo xtask peers` (torch 2.11.0).
set -euo pipefail
# As dp_scaling.sh: restarted under setsid so the run is its own scheduling group, niced -20 when allowed.
if [ -z "${TENSOR_PARALLEL_SETSID:-}" ] && command -v setsid >/dev/null; then
  TENSOR_PARALLEL_SETSID=1 exec setsid -w "$0" "$@"
fi
echo -20 >"/proc/$$/autogroup" 2>/dev/null || echo "tensor_parallel: cannot raise this group's priority; figures share the cores" >&2
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-5}
size=${SIZE:-small}
steps=${STEPS:-30}
skip=${SKIP:-5}
case "$size" in
  small) n_layer=4 d_model=256 n_head=8 seq_len=256 micro_batch=8 ;;
  medium) n_layer=6 d_model=512 n_head=8 seq_len=256 micro_batch=8 ;;
  *) echo "tensor_parallel: SIZE is small or medium, not $size" >&2; exit 2 ;;
esac
vocab=256
py=.stoke/venv/bin/python
torchrun=.stoke/venv/bin/torchrun
stoke=target/release/stoke
[ -x "$stoke" ] || { echo "tensor_parallel: no $stoke (cargo build --release --bin stoke)" >&2; exit 1; }
dir=runs/tensor-parallel
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.11.0') else 1)" \
  || { echo "tensor_parallel: the peer needs torch 2.11.0 (cargo xtask peers)" >&2; exit 1; }
echo "code $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates src 2>/dev/null || echo ' (+ uncommitted Rust changes)'); binary built $(date -r "$stoke" '+%F %T')"
echo "shape $size: n_layer $n_layer, d_model $d_model ($n_head heads of $((d_model / n_head))), context $seq_len, micro-batch $micro_batch, vocab $vocab; $steps steps, first $skip left out; $rounds rounds"
if [ -n "${SP:-}" ]; then
  echo "sequence parallelism on both sides (SP): stoke dist.sequence_parallel=true, the peer's --sequence-parallel"
else
  echo "sequence parallelism off (SP=1 turns it on for both)"
fi
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); scheduling group: $(cat /proc/$$/autogroup 2>/dev/null)"

stoke_args=(--quiet --set dist.tensor=2 --set 'model.family="gpt-rms"' --set run.dir="$dir"
  --set model.n_layer="$n_layer" --set model.d_model="$d_model" --set model.n_head="$n_head"
  --set model.seq_len="$seq_len" --set model.vocab_size="$vocab" --set train.micro_batch="$micro_batch"
  --set train.steps="$steps" --set train.precision=fp32 --set train.threads=1 --set train.beta2=0.95
  --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false --set prof.enabled=false
  ${SP:+--set dist.sequence_parallel=true})
# torchrun starts each worker in a session of its own (start_new_session), so out of this script's scheduling
# group: the workers set their groups to this group's nice (stoke's ranks inherit it).
group_nice=$(sed -n 's/.* nice \(-\{0,1\}[0-9]*\)$/\1/p' "/proc/$$/autogroup" 2>/dev/null)
peer_args=(${group_nice:+--autogroup-nice "$group_nice"} --n-layer "$n_layer" --d-model "$d_model" --n-head "$n_head" --seq-len "$seq_len" --vocab "$vocab"
  --micro-batch "$micro_batch" --steps "$steps" --warmup-steps "$skip" --threads 1 --adamw fused
  --host-memory retain --head vocab --data "$dir/corpus.txt" ${PEER_COMPILE:+--compile} ${SP:+--sequence-parallel})

# metrics.jsonl -> "step_ms final_loss" (median of rank 0's steps after the first $skip).
stoke_stats() {
  python3 - "$1" "$skip" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(statistics.median(r["step_ms"] for r in rows[int(sys.argv[2]):]), rows[-1]["loss"])
PY
}

results="$dir/rounds.txt"
: >"$results"
for round in $(seq 1 "$rounds"); do
  "$stoke" launch --nproc 2 -- train "${stoke_args[@]}" --set run.name="stoke-$round" >"$dir/stoke-$round.log" 2>&1 \
    || { tail -20 "$dir/stoke-$round.log" >&2; exit 1; }
  read -r s_ms s_loss <<<"$(stoke_stats "$dir/stoke-$round/metrics.jsonl")"
  OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc_per_node 2 benches/peers/tp_gpt.py "${peer_args[@]}" \
    >"$dir/peer-$round.json" 2>"$dir/peer-$round.log" || { tail -20 "$dir/peer-$round.log" >&2; exit 1; }
  read -r p_ms p_loss p_styles <<<"$(python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read()); print(d['step_ms'], d['final_loss'], d['styles'] + ', AdamW ' + d['adamw'] + (', compiled' if d.get('compiled') else ', eager'))" "$dir/peer-$round.json")"
  [ "$round" = 1 ] && echo "peer: $p_styles"
  python3 - "$round" "$s_ms" "$p_ms" "$s_loss" "$p_loss" "$((micro_batch * seq_len))" <<'PY' | tee -a "$results"
import sys
r, s_ms, p_ms, s_loss, p_loss, tokens = sys.argv[1], *map(float, sys.argv[2:])
print(f"round {r}: stoke {s_ms:.1f} ms ({tokens / s_ms * 1e3:.0f} tok/s, final loss {s_loss:.3f}) | "
      f"PyTorch TP {p_ms:.1f} ms ({tokens / p_ms * 1e3:.0f} tok/s, final loss {p_loss:.3f}) | stoke/peer {s_ms / p_ms:.3f}",
      file=sys.stderr)
print(f"ROUND stoke_ms={s_ms:.3f} peer_ms={p_ms:.3f} ratio={s_ms / p_ms:.4f} stoke_tps={tokens / s_ms * 1e3:.1f} "
      f"peer_tps={tokens / p_ms * 1e3:.1f}")
PY
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import statistics, sys
rounds = [dict(kv.split("=") for kv in l.split()[1:]) for l in open(sys.argv[1]) if l.startswith("ROUND")]
names = {
    "stoke_ms": "stoke step ms (median of steady steps)",
    "peer_ms": "PyTorch TP step ms",
    "stoke_tps": "stoke tokens/s",
    "peer_tps": "PyTorch TP tokens/s",
    "ratio": "step time stoke / PyTorch TP (below 1: stoke faster)",
}
print(f"\n{len(rounds)} interleaved rounds; median [min, max]:")
for key, label in names.items():
    v = [float(r[key]) for r in rounds]
    print(f"  {label}: {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
PY
