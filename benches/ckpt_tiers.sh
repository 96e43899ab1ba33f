#!/usr/bin/env bash
# Time to resume from each checkpoint tier: the local folder, and an S3-compatible server on
# loopback (moto's server mode, installed into the project's Python and started here, stopped
# after). One run trains a state of about 25 M parameters (300 MB with AdamW's moments) with
# ckpt.mirror set; then the same extension is resumed twice: from the local tier, and after its
# checkpoints are deleted, from the mirror. Prints fetch (download) and load (read + CRC-32)
# seconds and MB/s for each, from checkpoint-stats.json, beside the disk's write and read
# bandwidth (`stoke bench limits`). One run each.
#
#   benches/ckpt_tiers.sh [STOKE_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
STOKE="${1:-target/release/stoke}"
[ -x "$STOKE" ] || cargo build --release --quiet --bin stoke
PY=.stoke/venv/bin/python
"$PY" -c "import moto.server, flask" 2>/dev/null || "$PY" -m pip install --quiet "moto[server]==5.2.5"
DIR=runs/bench-ckpt-tiers
rm -rf "$DIR" && mkdir -p "$DIR"
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
"$PY" -m moto.server -H 127.0.0.1 -p "$PORT" >"$DIR/moto.log" 2>&1 &
MOTO=$!
trap 'kill $MOTO 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.2; done
curl -s -X PUT "http://127.0.0.1:$PORT/bench" >/dev/null
export AWS_ENDPOINT_URL="http://127.0.0.1:$PORT" AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=bench \
    AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
SET=(--set model.n_layer=4 --set model.d_model=640 --set model.n_head=8 --set model.seq_len=32
     --set train.micro_batch=1 --set train.precision=fp32 --set train.warmup_steps=2 --set prof.enabled=false
     --set run.dir="$DIR" --set run.name=tiers --set ckpt.every=0 --set ckpt.mirror=s3://bench/tiers)
"$STOKE" train --quiet "${SET[@]}" --set train.steps=4 | grep -E "^mirror:"
cp -r "$DIR/tiers" "$DIR/tiers-local"
"$STOKE" train --quiet --resume "${SET[@]}" --set run.name=tiers-local --set ckpt.mirror="" \
    --set train.steps=5 --set ckpt.at_end=false >/dev/null
rm -rf "$DIR/tiers/checkpoints"
"$STOKE" train --quiet --resume "${SET[@]}" --set train.steps=5 --set ckpt.at_end=false >/dev/null
"$PY" - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
for name in ("tiers-local", "tiers"):
    r = json.load(open(f"{d}/{name}/checkpoint-stats.json"))["resume"]
    mb = r["bytes"] / 1e6
    total = r["fetch_s"] + r["load_s"]
    fetch = f"fetch {r['fetch_s']:.2f} s ({mb / r['fetch_s']:.0f} MB/s), " if r["fetch_s"] > 0 else ""
    print(f"resume from the {r['tier']}: {mb:.0f} MB, {fetch}load+verify {r['load_s']:.2f} s; "
          f"{total:.2f} s in all ({mb / total:.0f} MB/s)")
PY
"$STOKE" bench limits --dir "$DIR" | grep -i "disk"
