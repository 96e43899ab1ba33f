#!/usr/bin/env bash
# Profiler overhead, always-on vs off, measured in one run: `stoke doctor --overhead BLOCK` hands
# the profiler (trace.json, /metrics, the step report's bookkeeping) alternate blocks of BLOCK steps
# and compares the step cadence with and without it, so the drift of a shared machine cancels.
# The profiler's self-measured cost (report.json's profiler_overhead_ms, the median step) is
# printed beside it.
#
#   benches/prof_overhead.sh [STEPS] [BLOCK] [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-300}"
block="${2:-10}"
shift $(( $# > 2 ? 2 : $# )) || true
name="prof-overhead-$(date -u +%Y%m%d-%H%M%S)"
cargo build --release --bin stoke
./target/release/stoke doctor --steps "$steps" --overhead "$block" --set run.name="$name" --set prof.prometheus_port=0 "$@" \
  | grep -E "^(step report|  effective|  outlier|profiler overhead)"
python3 - "runs/$name" <<'PY'
import json, sys
run = sys.argv[1]
o = json.load(open(f"{run}/overhead.json"))
r = json.load(open(f"{run}/report.json"))
print(f"on {o['on_ms_per_step']:.3f} ms/step, off {o['off_ms_per_step']:.3f} ms/step, "
      f"overhead {100 * o['overhead_fraction']:+.2f}% (median of {o['n_block_pairs']} block pairs); "
      f"self-measured {r['profiler_overhead_ms']:.3f} ms/step = {100 * r['profiler_overhead_ms'] / r['step_ms']:.3f}% of {r['step_ms']:.1f} ms")
PY
