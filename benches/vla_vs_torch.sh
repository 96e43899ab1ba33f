#!/usr/bin/env bash
# stoke's vision-language-action model (model.family = "vla") against its PyTorch twin
# (benches/peers/vla_torch.py: the same parameters and init, torch.compile, the fastest attention
# picked by timing in each of its runs, fused AdamW, autocast bf16, bf16's products native or widened
# to fp32 as stoke's, picked by timing in each of its runs) at the same preset, micro-batch,
# precision, optimizer and thread count. Rounds interleave the two (stoke, peer, stoke, peer, ...)
# so that the machine's load falls on both alike; each run's figure is its median step time over
# the steps after the first two (stoke: report.json's step_ms with prof.skip_steps = 2; the peer:
# --warmup 2, its compilation inside them). Prints, per precision, each round's ratio stoke / peer
# of the step times and their median [min, max], after the machine's matmul peaks
# (`stoke bench limits`). The peer's batches are made before its timing, stoke's step includes its
# data wait (under 1% of the step here), so the ratio slightly favours the peer.
#
#   benches/vla_vs_torch.sh [ROUNDS] [PRECISIONS...]      (defaults: 3 bf16; e.g. 5 bf16 fp32)
#   MICRO_BATCH=8      sequences per micro-batch, both sides
#   STEPS=20           stoke's train.steps; the peer runs as many (2 warm-up + STEPS - 2 timed)
#   PRESET=vla-small   or vla-tiny (a smoke run)
#   THREADS=0          intra-op threads of both (0: libtorch's default, one per physical core)
#   PEER_FLAGS=""      more flags for the peer, e.g. "--no-compile" or "--attention sdpa"
#   LIMITS=1           0 skips `stoke bench limits`
#   STOKE=target/release/stoke (built with `cargo build --release --bin stoke` when missing or
#   older than the vla family); the peer's Python is .stoke/venv (`cargo xtask peers`).
# Every run's figures: runs/bench-vla-vs-torch/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
precisions=("$@")
[ ${#precisions[@]} -eq 0 ] && precisions=(bf16)
micro=${MICRO_BATCH:-8}
steps=${STEPS:-20}
preset=${PRESET:-vla-small}
threads=${THREADS:-0}
read -r -a peer_flags <<<"${PEER_FLAGS:-}"
stoke=${STOKE:-target/release/stoke}
py=.stoke/venv/bin/python
dir=runs/bench-vla-vs-torch
if (( steps < 3 )); then
  echo "vla_vs_torch: STEPS must be at least 3 (two warm-up steps, then the timed ones)" >&2
  exit 2
fi
if [[ ! -x "$stoke" ]] || ! grep -qa "vla-small" "$stoke"; then
  echo "vla_vs_torch: $stoke is missing or predates the vla family; building it" >&2
  cargo build --release --bin stoke
  stoke=target/release/stoke
fi
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "vla_vs_torch: $py cannot import torch; run: cargo xtask peers" >&2
  exit 2
fi
rm -rf "$dir" && mkdir -p "$dir"
results="$dir/results.jsonl"
: > "$results"
if [ "${LIMITS:-1}" != 0 ]; then
  "$stoke" bench limits --dir "$dir" --bytes 268435456 | grep -iE "matmul|gflop" || true
fi

stoke_run() { # precision round -> one JSON line
  local name="stoke-$1-$2"
  "$stoke" train --quiet --set run.dir="$dir" --set run.name="$name" \
    --set model.family=vla --set model.preset="$preset" --set train.precision="$1" \
    --set train.micro_batch="$micro" --set train.steps="$steps" --set train.threads="$threads" \
    --set ckpt.every=0 --set ckpt.at_end=false --set eval.every=0 --set prof.skip_steps=2 \
    --set prof.prometheus=false --set prof.html=false --set prof.trace=false >/dev/null
  python3 - "$dir/$name/report.json" "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"side": "stoke", "precision": sys.argv[2], "round": int(sys.argv[3]), "step_ms": r["step_ms"],
                  "n_params": r["model"]["n_params"], "peak_flops_bf16": r["machine"].get("peak_flops_bf16")}))
PY
}

peer_run() { # precision round -> one JSON line
  local out="$dir/peer-$1-$2.json"
  "$py" benches/peers/vla_torch.py --preset "$preset" --micro-batch "$micro" --precision "$1" \
    --steps $((steps - 2)) --warmup 2 --threads "$threads" --json "$out" "${peer_flags[@]}" >"$dir/peer-$1-$2.log" 2>&1 \
    || { cat "$dir/peer-$1-$2.log" >&2; exit 1; }
  python3 - "$out" "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"side": "peer", "precision": sys.argv[2], "round": int(sys.argv[3]), "step_ms": r["step_ms"],
                  "n_params": r["n_params"], "attention": r["attention"], "compile_s": r["compile_s"],
                  "threads": r["threads"], "products": r.get("products", "native")}))
PY
}

for precision in "${precisions[@]}"; do
  for round in $(seq 1 "$rounds"); do
    stoke_run "$precision" "$round" | tee -a "$results"
    peer_run "$precision" "$round" | tee -a "$results"
  done
done

python3 - "$results" "$preset" "$micro" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
preset, micro = sys.argv[2], sys.argv[3]
stoke_params = {r["n_params"] for r in rows if r["side"] == "stoke"}
peer_params = {r["n_params"] for r in rows if r["side"] == "peer"}
assert stoke_params == peer_params and len(stoke_params) == 1, \
    f"parameter counts differ: stoke {sorted(stoke_params)}, peer {sorted(peer_params)}"
print(f"{preset}, micro-batch {micro}, {stoke_params.pop():,} parameters on both sides")
peaks = [r["peak_flops_bf16"] for r in rows if r["side"] == "stoke" and r.get("peak_flops_bf16")]
if peaks:
    print(f"bf16 matmul peak in stoke's report.json: {peaks[-1] / 1e9:.0f} GFLOP/s")
for precision in dict.fromkeys(r["precision"] for r in rows):
    stoke = [r for r in rows if r["side"] == "stoke" and r["precision"] == precision]
    peer = [r for r in rows if r["side"] == "peer" and r["precision"] == precision]
    ratios = [s["step_ms"] / p["step_ms"] for s, p in zip(stoke, peer)]
    attention = sorted({f"vision {p['attention']['vision']}, backbone {p['attention']['backbone']}" for p in peer})
    products = sorted({p.get("products", "native") for p in peer})
    print(f"{precision}: stoke {statistics.median(r['step_ms'] for r in stoke):.1f} ms/step, "
          f"peer {statistics.median(r['step_ms'] for r in peer):.1f} ms/step "
          f"(attention: {'; '.join(attention)}; products: {', '.join(products)}; "
          f"compile {statistics.median(p['compile_s'] for p in peer):.0f} s)")
    print(f"  stoke / peer per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
PY
