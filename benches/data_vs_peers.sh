#!/usr/bin/env bash
# Tokens/s delivered to the trainer: stoke's loader against three Python pipelines over the same
# tokens (the built-in corpus, byte-level, as u16), the same batch shape and sample cut, in one run.
# Also: this machine's memcpy bandwidth, batch assembly's share of it, and the time to first batch
# on a 10^9-token prepared dataset. Prints every figure and the ratios.
#
#   benches/data_vs_peers.sh            # BATCH=16 SEQ=1024 MB=64 by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.stoke/venv/bin/python}
WORK=$(realpath -m "${WORK:-target/data-bench}") # absolute: cargo bench runs in the crate folder
BATCH=${BATCH:-16}
SEQ=${SEQ:-1024}
MB=${MB:-64}
mkdir -p "$WORK"

echo "== stoke loader (cargo bench, release)"
cargo bench -q -p stoke-data --bench loader -- \
  --text "$WORK/corpus.txt" --corpus-bytes $((MB << 20)) --data "$WORK/prepared" \
  --batch "$BATCH" --seq "$SEQ" --steps 3000 --scratch "$WORK" --json "$WORK/stoke.json"

echo "== peer (a): torch DataLoader, per-sample tokenization"
"$PY" benches/peers/data_torch_naive.py --text "$WORK/corpus.txt" --batch "$BATCH" --seq "$SEQ" \
  --steps 300 | tee "$WORK/peer_a.json"
echo "== peer (b): nanoGPT np.memmap get_batch"
"$PY" benches/peers/data_nanogpt.py --bin "$WORK/prepared/shard-00000.bin" --batch "$BATCH" --seq "$SEQ" \
  --steps 2000 | tee "$WORK/peer_b.json"
echo "== peer (c): mosaicml-streaming"
"$PY" benches/peers/data_streaming.py --bin "$WORK/prepared/shard-00000.bin" --mds "$WORK/mds" \
  --batch "$BATCH" --seq "$SEQ" --steps 2000 | tee "$WORK/peer_c.json"

"$PY" - "$WORK" <<'PYEOF'
import json, sys
work = sys.argv[1]
stoke = json.load(open(f"{work}/stoke.json"))
rate = stoke["tokens_per_s"]
print(f"\nstoke loader: {rate / 1e6:.1f} M tokens/s (batch {stoke['batch']} x seq {stoke['seq']})")
for name, target in [("peer_a", 10), ("peer_b", 3), ("peer_c", 3)]:
    peer = json.loads(open(f"{work}/{name}.json").read().strip().splitlines()[-1])
    ratio = rate / peer["tokens_per_s"]
    print(f"  vs {peer['peer']}: {peer['tokens_per_s'] / 1e6:.2f} M tokens/s -> {ratio:.1f}x (target {target}x)")
print(f"batch assembly (1 thread, CPU time) = {100 * stoke['assembly_share_of_memcpy_1_thread']:.0f}% of 1-thread memcpy; "
      f"loader (2 workers) = {100 * stoke['loader_share_of_memcpy_2_threads']:.0f}% of 2-thread memcpy")
if stoke.get("first_batch_s") is not None:
    print(f"time to first batch on {stoke['first_batch_tokens']:.0e} tokens: {stoke['first_batch_s'] * 1e3:.1f} ms")
PYEOF
