#!/usr/bin/env bash
# A PyTorch training loop fed by `stoke.data` (the wheel, pip-installed into a fresh environment)
# against the same loop fed by a torch DataLoader over the same prepared shards (benches/peers/
# py_loop.py: numpy memory maps, whole-batch __getitems__) at its best worker count, measured in
# this invocation, and against batches already in memory (no data cost). Interleaved rounds
# stoke, torch, memory, stoke, ...; prints each run's JSON line, then medians and spreads.
#
#   benches/py_loader.sh       # ROUNDS=5 BATCH=16 SEQ=256 D_MODEL=64 HIDDEN=256 MB=64 STEPS=300
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.stoke/venv/bin/python}
WORK=$(realpath -m "${WORK:-target/py-bench}")
ROUNDS=${ROUNDS:-5}
MB=${MB:-64}
LOOP_ARGS="--batch ${BATCH:-16} --seq ${SEQ:-256} --d-model ${D_MODEL:-64} --hidden ${HIDDEN:-256} --steps ${STEPS:-300}"
mkdir -p "$WORK"

echo "== the wheel, into a fresh environment (torch read from .stoke/venv through a .pth file)"
rm -f target/wheels/stoke-*.whl
"$PY" -m maturin build --release --quiet --manifest-path crates/py/Cargo.toml --out target/wheels
"$PY" -m venv --clear "$WORK/venv"
VPY=$WORK/venv/bin/python
"$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
  > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/stoke-torch.pth"
"$VPY" -m pip install --quiet --no-input target/wheels/stoke-*.whl

if [ ! -f "$WORK/prepared/manifest.json" ]; then
  echo "== $MB MiB of text prepared once (byte-level tokens, u16 shards)"
  "$VPY" - "$WORK" "$MB" <<'PYEOF'
import random, sys, stoke.prep
work, mb = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
words = [bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))).decode() for _ in range(5000)]
with open(f"{work}/corpus.txt", "w") as f:
    written = 0
    while written < mb << 20:
        line = " ".join(rng.choices(words, k=100)) + ".\n"
        f.write(line)
        written += len(line)
stoke.prep.text([f"{work}/corpus.txt"], f"{work}/prepared", shard_tokens=1 << 25, force=True)
PYEOF
fi
DATA=$WORK/prepared
cd "$WORK"  # so `import stoke` can only be the installed wheel
loop() { "$VPY" "$ROOT/benches/peers/py_loop.py" --data "$DATA" $LOOP_ARGS "$@"; }

echo "== the DataLoader's worker count, swept"
: > sweep.jsonl
for workers in 0 1 2 3 4; do loop --feed torch --workers "$workers" --steps 150 | tee -a sweep.jsonl; done
BEST=$("$VPY" -c "import json; r=[json.loads(l) for l in open('sweep.jsonl')]; print(max(r, key=lambda x: x['tokens_per_s'])['workers'])")
echo "best: num_workers=$BEST"

echo "== interleaved rounds"
: > rounds.jsonl
for round in $(seq "$ROUNDS"); do
  loop --feed stoke --workers 2 | tee -a rounds.jsonl
  loop --feed torch --workers "$BEST" | tee -a rounds.jsonl
  loop --feed memory | tee -a rounds.jsonl
done

"$VPY" - <<'PYEOF'
import json, statistics
runs = [json.loads(l) for l in open("rounds.jsonl")]
by = {f: [r for r in runs if r["feed"] == f] for f in ("stoke", "torch", "memory")}
def summary(values):
    return statistics.median(values), min(values), max(values)
for feed, rs in by.items():
    m, lo, hi = summary([r["tokens_per_s"] for r in rs])
    w, wlo, whi = summary([r["data_wait_share"] for r in rs])
    print(f"{feed:7s} tokens/s median {m/1e3:.1f} k (min {lo/1e3:.1f}, max {hi/1e3:.1f}); "
          f"data wait {100*w:.2f}% ({100*wlo:.2f}-{100*whi:.2f}); workers {rs[0]['workers']}")
# Ratios per round (the runs of one round are neighbours in time), then their median and range.
n = len(by["stoke"])
over_torch = [by["stoke"][i]["tokens_per_s"] / by["torch"][i]["tokens_per_s"] for i in range(n)]
over_memory = [by["stoke"][i]["tokens_per_s"] / by["memory"][i]["tokens_per_s"] for i in range(n)]
for name, ratios in [("stoke / torch DataLoader", over_torch), ("stoke / batches in memory", over_memory)]:
    m, lo, hi = summary(ratios)
    print(f"{name}: median {m:.3f}x (min {lo:.3f}, max {hi:.3f}) over {n} rounds")
PYEOF
