#!/usr/bin/env bash
# The block executor's benchmark: activation memory saved and step time added by each
# recomputation policy, stoke against PyTorch with torch.utils.checkpoint on the same parts
# (benches/peers/recompute_gpt.py), and the block executor against the single-graph step.
# Runs are interleaved (stoke, peer, stoke, peer, ...); step times are medians of each run's steps
# after the first 3; activation bytes are glibc's bytes in use at the end of the forward minus
# before it, the same measurement on both sides.
#
#   benches/recompute.sh [steps] [pairs] [presets...]     (defaults: 30 3 tiny small)
# Needs `cargo xtask peers` and a release build (`cargo build --release`).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
pairs=${2:-3}
shift $(( $# > 2 ? 2 : $# )) || true
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(tiny small)
py=.stoke/venv/bin/python
stoke=target/release/stoke
dir=runs/bench-recompute
rm -rf "$dir" && mkdir -p "$dir"
"$stoke" corpus --out "$dir/corpus.txt" >/dev/null
prio=()
if chrt -f 10 true 2>/dev/null; then prio=(chrt -f 10); fi
results="$dir/results.jsonl"
: > "$results"

stoke_run() { # preset policy executor pair -> one JSON line
  local name="$1-$2-$3-$4"
  "${prio[@]}" "$stoke" train --quiet --data "$dir/corpus.txt" --set run.dir="$dir" --set run.name="$name" \
    --set model.preset="$1" --set train.recompute="$2" --set train.executor="$3" --set train.steps="$steps" \
    --set train.micro_batch=16 --set prof.skip_steps=3 --set ckpt.every=0 --set ckpt.at_end=false \
    --set prof.prometheus=false --set prof.html=false --set prof.trace=false >/dev/null
  python3 - "$dir/$name/report.json" "$1" "$2" "$3" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"side": "stoke", "preset": sys.argv[2], "recompute": sys.argv[3], "executor": sys.argv[4],
                  "step_ms": r["step_ms"], "activation_bytes": r["train"].get("activation_bytes")}))
PY
}

peer_run() { # preset policy
  "${prio[@]}" "$py" benches/peers/recompute_gpt.py --data "$dir/corpus.txt" --preset "$1" --recompute "$2" \
    --steps "$steps" --micro-batch 16 | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
print(json.dumps({'side': 'pytorch', 'preset': r['preset'], 'recompute': r['recompute'], 'executor': '-',
                  'step_ms': r['step_ms'], 'activation_bytes': r['activation_bytes']}))"
}

for preset in "${presets[@]}"; do
  for pair in $(seq 1 "$pairs"); do
    for policy in none mlp attention block; do
      stoke_run "$preset" "$policy" blocks "$pair" | tee -a "$results"
      peer_run "$preset" "$policy" | tee -a "$results"
    done
    stoke_run "$preset" none single-graph "$pair" | tee -a "$results"
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def runs(**kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]
def med(values):
    return statistics.median(values)
print("\n| preset | policy | stoke act. MiB | saved | stoke step ms | added | PyTorch act. MiB | saved | PyTorch step ms | added | stoke/PyTorch step (median [min, max] of pairs) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for preset in dict.fromkeys(r["preset"] for r in rows):
    base_s = runs(side="stoke", preset=preset, recompute="none", executor="blocks")
    base_p = runs(side="pytorch", preset=preset, recompute="none")
    for policy in ["none", "mlp", "attention", "block"]:
        s = runs(side="stoke", preset=preset, recompute=policy, executor="blocks")
        p = runs(side="pytorch", preset=preset, recompute=policy)
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(s, p)]
        sa, pa = med([r["activation_bytes"] for r in s]), med([r["activation_bytes"] for r in p])
        sb, pb = med([r["activation_bytes"] for r in base_s]), med([r["activation_bytes"] for r in base_p])
        st, pt = med([r["step_ms"] for r in s]), med([r["step_ms"] for r in p])
        stb, ptb = med([r["step_ms"] for r in base_s]), med([r["step_ms"] for r in base_p])
        print(f"| {preset} | {policy} | {sa / 2**20:.1f} | {1 - sa / sb:.0%} | {st:.1f} | {st / stb - 1:+.0%} | "
              f"{pa / 2**20:.1f} | {1 - pa / pb:.0%} | {pt:.1f} | {pt / ptb - 1:+.0%} | "
              f"{med(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")
print("\n| preset | block executor / single graph, step time (median [min, max] of pairs) |")
print("|---|---|")
for preset in dict.fromkeys(r["preset"] for r in rows):
    b = runs(side="stoke", preset=preset, recompute="none", executor="blocks")
    g = runs(side="stoke", preset=preset, recompute="none", executor="single-graph")
    ratios = [x["step_ms"] / y["step_ms"] for x, y in zip(b, g)]
    print(f"| {preset} | {med(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")
PY
