#!/usr/bin/env bash
# A PyTorch training loop fed by `stoke.data` (the wheel, pip-installed into a fresh environment)
# against the same loop fed by a torch DataLoader over the same prepared shards (benches/peers/
# py_loop.py: numpy memory maps, whole-batch __getitems__) at its best worker count, measured in
# this invocation, and against batches already in memory (no data cost). Interleaved rounds
# stoke, torch, memory, stoke, ...; prints each run's JSON line, then medians and spreads.
#
#   benches/py_loader.sh   # ROUNDS=7 BATCH=16 SEQ=256 D_MODEL=64 HIDDEN=256 THREADS=1 MB=64 STEPS=200
#
# KIND=episodes: robot episodes instead of text (stoke's built-in set, 224x224 JPEG frames, EPISODES
# of 16 steps), a small vision-to-action model (PATCH the patch side), stoke.data.EpisodeLoader
# decoding and augmenting the kept JPEG bytes against a DataLoader decoding and augmenting with
# torchvision (benches/peers/episodes_torch.py); the rate is samples/s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.stoke/venv/bin/python}
WORK=$(realpath -m "${WORK:-target/py-bench}")
ROUNDS=${ROUNDS:-7}
MB=${MB:-64}
KIND=${KIND:-tokens}
LOOP_ARGS="--batch ${BATCH:-16} --seq ${SEQ:-256} --d-model ${D_MODEL:-64} --hidden ${HIDDEN:-256} --threads ${THREADS:-1} --steps ${STEPS:-200}"
mkdir -p "$WORK"

echo "== the wheel, into a fresh environment (torch read from .stoke/venv through a .pth file)"
rm -f target/wheels/stoke-*.whl
"$PY" -m maturin build --release --quiet --manifest-path crates/py/Cargo.toml --out target/wheels
rm -rf "$WORK/venv"
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
  > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/stoke-torch.pth"
"$VPY" -m pip install --quiet --no-input target/wheels/stoke-*.whl

if [ "$KIND" = episodes ]; then
  if [ ! -f "$WORK/episodes/prepared/manifest.json" ]; then
    echo "== ${EPISODES:-64} episodes written (JPEG frames) and prepared once, the JPEG bytes kept"
    "$VPY" - "$WORK/episodes" "${EPISODES:-64}" <<'PYEOF'
import sys, stoke.prep
out, n = sys.argv[1], int(sys.argv[2])
stoke.prep.synthetic_episodes(f"{out}/raw", n_episodes=n, steps_per_episode=16, resolution=224)
stoke.prep.episodes(f"{out}/raw", f"{out}/prepared", resolution=224, keep_encoded=True, force=True)
PYEOF
  fi
  LOOP_ARGS="$LOOP_ARGS --kind episodes --data $WORK/episodes/raw --prepared $WORK/episodes/prepared --patch ${PATCH:-16}"
  FEEDS="torch"
elif [ ! -f "$WORK/prepared/manifest.json" ]; then
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
FEEDS=${FEEDS:-torch torch-sample}
[ "$KIND" = episodes ] || LOOP_ARGS="$LOOP_ARGS --data $WORK/prepared"
cd "$WORK"  # so `import stoke` can only be the installed wheel
loop() { "$VPY" -W ignore "$ROOT/benches/peers/py_loop.py" $LOOP_ARGS "$@"; }

echo "== the DataLoader's worker count, swept (twice, interleaved), for both Dataset styles"
: > sweep.jsonl
for pass in 1 2; do
  for workers in 0 1 2 3; do
    for feed in $FEEDS; do
      loop --feed "$feed" --workers "$workers" --steps 100 | tee -a sweep.jsonl
    done
  done
done
best() {
  "$VPY" - "$1" <<'PYEOF'
import json, statistics, sys
runs = [json.loads(l) for l in open("sweep.jsonl") if json.loads(l)["feed"] == sys.argv[1]]
key = "samples_per_s" if "samples_per_s" in runs[0] else "tokens_per_s"
rate = {w: statistics.median(r[key] for r in runs if r["workers"] == w) for w in {r["workers"] for r in runs}}
print(max(rate, key=rate.get))
PYEOF
}
BEST=$(best torch)
if [ "$KIND" = episodes ]; then
  echo "best: num_workers=$BEST"
else
  BEST_SAMPLE=$(best torch-sample)
  echo "best: num_workers=$BEST (whole batches), $BEST_SAMPLE (per sample)"
fi

echo "== interleaved rounds"
: > rounds.jsonl
for round in $(seq "$ROUNDS"); do
  loop --feed stoke --workers 2 | tee -a rounds.jsonl
  loop --feed torch --workers "$BEST" | tee -a rounds.jsonl
  [ "$KIND" = episodes ] || loop --feed torch-sample --workers "$BEST_SAMPLE" | tee -a rounds.jsonl
  loop --feed memory | tee -a rounds.jsonl
done

"$VPY" - <<'PYEOF'
import json, statistics
runs = [json.loads(l) for l in open("rounds.jsonl")]
feeds = [f for f in ("stoke", "torch", "torch-sample", "memory") if any(r["feed"] == f for r in runs)]
by = {f: [r for r in runs if r["feed"] == f] for f in feeds}
key, unit = ("samples_per_s", "samples/s") if "samples_per_s" in runs[0] else ("tokens_per_s", "tokens/s")
def summary(values):
    return statistics.median(values), min(values), max(values)
for feed, rs in by.items():
    m, lo, hi = summary([r[key] for r in rs])
    w, wlo, whi = summary([r["data_wait_share"] for r in rs])
    print(f"{feed:12s} {unit} median {m/1e3:.3f} k (min {lo/1e3:.3f}, max {hi/1e3:.3f}); "
          f"data wait {100*w:.2f}% ({100*wlo:.2f}-{100*whi:.2f}); workers {rs[0]['workers']}")
# Ratios per round (the runs of one round are neighbours in time), then their median and range.
n = len(by["stoke"])
def over(peer):
    return [by["stoke"][i][key] / by[peer][i][key] for i in range(n)]
names = {"torch": "DataLoader" + (", whole batches" if key == "tokens_per_s" else ""), "torch-sample": "DataLoader, per sample", "memory": "batches in memory"}
for name, ratios in [(f"stoke / {names[f]}", over(f)) for f in feeds[1:]]:
    m, lo, hi = summary(ratios)
    print(f"{name}: median {m:.3f}x (min {lo:.3f}, max {hi:.3f}) over {n} rounds")
PYEOF
