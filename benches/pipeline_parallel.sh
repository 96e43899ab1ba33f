#!/usr/bin/env bash
# Pipeline parallelism over 2 processes against PyTorch's, in interleaved rounds (stoke, peer, stoke, peer ...):
#
#   stoke   `stoke launch --nproc 2 -- train --set dist.pipeline=2`: one copy of the default gpt model cut
#           into 2 stages (the embedding and the first half of the blocks; the second half, the final
#           norm and the tied head), train.grad_accum = M micro-batches a step run by the 1F1B,
#           GPipe or interleaved schedule over batched shm sends and receives, the tied embedding's
#           gradient sent to the first stage and its values back, the built-in byte corpus;
#   peer    benches/peers/pp_gpt.py under `torchrun --nproc_per_node 2` (gloo): the same model cut at the
#           same block with torch.distributed.pipelining (a PipelineStage a rank, Schedule1F1B or
#           ScheduleGPipe over the same M micro-batches), the head's copy of the tied matrix on the
#           last stage and the two copies' gradients all-reduced before the update, fused AdamW,
#           glibc keeping freed memory, windows of the same corpus (`stoke corpus`).
#
# Both: fp32 on the CPU, 1 libtorch thread per rank, no loader thread, M micro-batches of `micro-batch`
# rows a step (the mean of their losses), AdamW betas 0.9/0.95 with decay 0.1 on matrices, warmup then
# cosine, clipping at 1.0 over both stages' gradients, no checkpoints, no profiler. Step time: rank 0's
# (the first stage's) median over the steps after the first SKIP (stoke's metrics.jsonl, the peer's own
# JSON line); tokens/s: a step's tokens (micro-batch x M x seq_len) over it. Per round it prints both and
# the ratio stoke / peer of the median step times (below 1: stoke faster); at the end the median and
# [min, max] of each over the rounds.
#
#   benches/pipeline_parallel.sh                          # ROUNDS=5 SIZE=small STEPS=30 SKIP=5 SCHEDULE=1f1b M=4
#   SCHEDULE=gpipe M=8 benches/pipeline_parallel.sh
#   SCHEDULE=interleaved benches/pipeline_parallel.sh
#   PEER_COMPILE=1 benches/pipeline_parallel.sh           # each of the peer's stages under torch.compile
#
# SCHEDULE interleaved: 2 chunks a rank on both sides, the blocks cut into 4 chunks at the same blocks
# (rank r holding chunks r and r + 2; the embedding in chunk 0, the head in chunk 3): stoke's
# dist.pipeline_schedule "interleaved" against PyTorch's ScheduleInterleaved1F1B.
#
# SIZE small: 4 layers, d_model 256, 8 heads, context 256, micro-batch 8, vocab 256 (bytes);
#      medium: 6 layers, d_model 512, 8 heads, context 256, micro-batch 8, vocab 256.
# Needs a release build (cargo build --release --bin stoke) and `cargo xtask peers` (torch 2.11.0).
set -euo pipefail
# As dp_scaling.sh: restarted under setsid so the run is its own scheduling group, niced -20 when allowed.
if [ -z "${PIPELINE_PARALLEL_SETSID:-}" ] && command -v setsid >/dev/null; then
  PIPELINE_PARALLEL_SETSID=1 exec setsid -w "$0" "$@"
fi
echo -20 >"/proc/$$/autogroup" 2>/dev/null || echo "pipeline_parallel: cannot raise this group's priority; figures share the cores" >&2
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-5}
size=${SIZE:-small}
steps=${STEPS:-30}
skip=${SKIP:-5}
schedule=${SCHEDULE:-1f1b}
micro_batches=${M:-4}
case "$size" in
  small) n_layer=4 d_model=256 n_head=8 seq_len=256 micro_batch=8 ;;
  medium) n_layer=6 d_model=512 n_head=8 seq_len=256 micro_batch=8 ;;
  *) echo "pipeline_parallel: SIZE is small or medium, not $size" >&2; exit 2 ;;
esac
case "$schedule" in
  1f1b | gpipe | interleaved) with_stoke=1 ;;
  *) echo "pipeline_parallel: SCHEDULE is 1f1b, gpipe or interleaved, not $schedule" >&2; exit 2 ;;
esac
vocab=256
tokens=$((micro_batch * micro_batches * seq_len))
py=.stoke/venv/bin/python
torchrun=.stoke/venv/bin/torchrun
stoke=target/release/stoke
[ -x "$stoke" ] || { echo "pipeline_parallel: no $stoke (cargo build --release --bin stoke)" >&2; exit 1; }
dir=runs/pipeline-parallel-$schedule
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
"$py" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.11.0') else 1)" \
  || { echo "pipeline_parallel: the peer needs torch 2.11.0 (cargo xtask peers)" >&2; exit 1; }
echo "code $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates src 2>/dev/null || echo ' (+ uncommitted Rust changes)'); binary built $(date -r "$stoke" '+%F %T')"
echo "shape $size: n_layer $n_layer, d_model $d_model ($n_head heads of $((d_model / n_head))), context $seq_len, vocab $vocab;" \
  "schedule $schedule, $micro_batches micro-batches of $micro_batch rows ($tokens tokens a step); $steps steps, first $skip left out; $rounds rounds"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); scheduling group: $(cat /proc/$$/autogroup 2>/dev/null)"

# Both cut at the same block: the first stage the embedding and n_layer / 2 blocks, the second the rest and
# the head (stoke's units: the embedding, each block, the head); interleaved, chunk c the blocks from
# c n_layer / 4 (the peer's chunk_bounds), the embedding with chunk 0 and the head with chunk 3.
chunks=$([ "$schedule" = interleaved ] && echo 4 || echo 2)
split=$(python3 -c "import sys; n, c = int(sys.argv[1]), int(sys.argv[2]); b = [i * n // c for i in range(c + 1)]
print(','.join(str(b[i + 1] - b[i] + (i == 0) + (i == c - 1)) for i in range(c)))" "$n_layer" "$chunks")
stoke_args=(--quiet --set dist.pipeline=2 --set "dist.pipeline_schedule=\"$schedule\""
  --set "dist.pipeline_split=\"$split\"" --set run.dir="$dir"
  --set model.n_layer="$n_layer" --set model.d_model="$d_model" --set model.n_head="$n_head"
  --set model.seq_len="$seq_len" --set model.vocab_size="$vocab" --set train.micro_batch="$micro_batch"
  --set train.grad_accum="$micro_batches" --set train.steps="$steps" --set train.precision=fp32
  --set train.threads=1 --set train.beta2=0.95 --set data.workers=0 --set ckpt.every=0 --set ckpt.at_end=false
  --set prof.enabled=false)
# torchrun starts each worker in a session of its own (start_new_session), so out of this script's scheduling
# group: the workers set their groups to this group's nice (stoke's ranks inherit it).
group_nice=$(sed -n 's/.* nice \(-\{0,1\}[0-9]*\)$/\1/p' "/proc/$$/autogroup" 2>/dev/null)
peer_args=(${group_nice:+--autogroup-nice "$group_nice"} --n-layer "$n_layer" --d-model "$d_model" --n-head "$n_head"
  --seq-len "$seq_len" --vocab "$vocab" --micro-batch "$micro_batch" --micro-batches "$micro_batches"
  --schedule "$schedule" --steps "$steps" --warmup-steps "$skip" --threads 1 --adamw fused --host-memory retain
  --data "$dir/corpus.txt" ${PEER_COMPILE:+--compile})

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
  s_ms=- s_loss=-
  if [ -n "$with_stoke" ]; then
    "$stoke" launch --nproc 2 -- train "${stoke_args[@]}" --set run.name="stoke-$round" >"$dir/stoke-$round.log" 2>&1 \
      || { tail -20 "$dir/stoke-$round.log" >&2; exit 1; }
    read -r s_ms s_loss <<<"$(stoke_stats "$dir/stoke-$round/metrics.jsonl")"
    [ "$round" = 1 ] && echo "stoke: $(grep -o "pipeline stages' units: .*" "$dir/stoke-$round.log" | head -1)"
  fi
  OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc_per_node 2 benches/peers/pp_gpt.py "${peer_args[@]}" \
    >"$dir/peer-$round.json" 2>"$dir/peer-$round.log" || { tail -20 "$dir/peer-$round.log" >&2; exit 1; }
  read -r p_ms p_loss p_layout <<<"$(python3 -c "import json,sys; d=json.loads(open(sys.argv[1]).read()); print(d['step_ms'], d['final_loss'], d['schedule'] + ': ' + '; '.join(d['layout']) + ', AdamW ' + d['adamw'] + (', compiled' if d.get('compiled') else ', eager'))" "$dir/peer-$round.json")"
  [ "$round" = 1 ] && echo "peer: $p_layout"
  python3 - "$round" "$s_ms" "$p_ms" "$s_loss" "$p_loss" "$tokens" <<'PY' | tee -a "$results"
import sys
r, s_ms, p_ms, s_loss, p_loss, tokens = sys.argv[1:]
p_ms, p_loss, tokens = float(p_ms), float(p_loss), float(tokens)
peer = f"PyTorch PP {p_ms:.1f} ms ({tokens / p_ms * 1e3:.0f} tok/s, final loss {p_loss:.3f})"
fields = f"peer_ms={p_ms:.3f}"
if s_ms == "-":
    print(f"round {r}: {peer}", file=sys.stderr)
else:
    s_ms, s_loss = float(s_ms), float(s_loss)
    print(f"round {r}: stoke {s_ms:.1f} ms ({tokens / s_ms * 1e3:.0f} tok/s, final loss {s_loss:.3f}) | {peer} | "
          f"stoke/peer {s_ms / p_ms:.3f}", file=sys.stderr)
    fields = f"stoke_ms={s_ms:.3f} {fields} ratio={s_ms / p_ms:.4f} stoke_tps={tokens / s_ms * 1e3:.1f}"
print(f"ROUND {fields} peer_tps={tokens / p_ms * 1e3:.1f}")
PY
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$results" <<'PY'
import statistics, sys
rounds = [dict(kv.split("=") for kv in l.split()[1:]) for l in open(sys.argv[1]) if l.startswith("ROUND")]
names = {
    "stoke_ms": "stoke step ms (median of steady steps)",
    "peer_ms": "PyTorch PP step ms",
    "stoke_tps": "stoke tokens/s",
    "peer_tps": "PyTorch PP tokens/s",
    "ratio": "step time stoke / PyTorch PP (below 1: stoke faster)",
}
print(f"\n{len(rounds)} interleaved rounds; median [min, max]:")
for key, label in names.items():
    if key in rounds[0]:
        v = [float(r[key]) for r in rounds]
        print(f"  {label}: {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
PY
