#!/usr/bin/env bash
# `stoke trace analyze` against HTA (HolisticTraceAnalysis) on the same traces: wall time and
# peak RSS of each, per fixture and on a synthetic multi-GB trace, plus the numbers of both
# side by side (benches/peers/compare_hta.py). Results are written up in benches/TRACE_VS_HTA.md.
#
# usage: benches/trace_vs_hta.sh            (fixtures + a ~2 GB synthetic trace)
#        SYNTH_MB=0 benches/trace_vs_hta.sh (fixtures only)
# env:   FIXTURES (default crates/prof/tests/fixtures/traces), SYNTH_MB
#        (default 2000), SYNTH_KERNELS_PER_STEP (default 50000),
#        WORK (default target/trace-bench; the synthetic trace is deleted afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
FIXTURES=${FIXTURES:-crates/prof/tests/fixtures/traces}
[ -d "$FIXTURES" ] && FIXTURES=$(cd "$FIXTURES" && pwd)
SYNTH_MB=${SYNTH_MB:-2000}
WORK=${WORK:-target/trace-bench}
PY=.stoke/venv/bin/python
mkdir -p "$WORK/stoke"

if ! "$PY" -c "import hta" 2>/dev/null; then
    echo "installing HolisticTraceAnalysis into .stoke/venv" >&2
    .stoke/venv/bin/pip install --quiet HolisticTraceAnalysis
fi
cargo build --release --quiet --bin stoke
cargo build --release --quiet -p stoke-prof --example trace_table
STOKE=target/release/stoke
# The same analyzer without the `stoke` binary's libtorch start-up (about 1 s and 120 MB here).
ALONE=target/release/examples/trace_table

# Runs a command under /usr/bin/time -v; prints "wall_seconds peak_rss_kb cpu_seconds" (wall time from the
# nanosecond clock: /usr/bin/time rounds to 10 ms).
measure() {
    local log t0 t1
    log=$(mktemp)
    t0=$(date +%s%N)
    /usr/bin/time -v "$@" >/dev/null 2>"$log" || { cat "$log" >&2; rm -f "$log"; return 1; }
    t1=$(date +%s%N)
    awk -F': ' -v ns=$((t1 - t0)) '/Maximum resident set size/ {r = $2} /User time|System time/ {c += $2}
                                   END {print ns / 1e9, r, c}' "$log"
    rm -f "$log"
}

report() { # name bytes stoke_wall stoke_rss stoke_cpu alone_wall alone_rss alone_cpu hta_wall hta_rss hta_cpu
    awk -v n="$1" -v b="$2" -v sw="$3" -v sr="$4" -v sc="$5" -v aw="$6" -v ar="$7" -v ac="$8" \
        -v hw="$9" -v hr="${10}" -v hc="${11}" 'BEGIN {
        printf "| %s | %.1f | %.2f (%.2f) | %.3f (%.3f) | %.2f (%.2f) | %.1fx | %.0fx | %.0f / %.0f / %.0f | %.1fx | %.2f |\n",
            n, b / 1e6, sw, sc, aw, ac, hw, hc, hw / sw, hw / aw, sr / 1024, ar / 1024, hr / 1024, hr / ar, ar * 1024 / b }'
}

echo "| trace | JSON MB | stoke s (CPU s) | analyzer-only s (CPU s) | HTA s (CPU s) | speed-up, stoke | speed-up, analyzer-only | peak RSS MB stoke / analyzer-only / HTA | HTA / analyzer-only RSS | analyzer-only RSS / JSON |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
if [ -d "$FIXTURES" ]; then
    for f in "$FIXTURES"/*.json.gz; do
        name=$(basename "$f")
        bytes=$(gzip -dc "$f" | wc -c)
        read -r sw sr sc < <(measure "$STOKE" trace analyze "$f" --format table)
        read -r aw ar ac < <(measure "$ALONE" "$f")
        read -r hw hr hc < <(measure "$PY" benches/peers/hta_analyze.py "$f")
        report "$name" "$bytes" "$sw" "$sr" "$sc" "$aw" "$ar" "$ac" "$hw" "$hr" "$hc"
        "$STOKE" trace analyze "$f" --format json >"$WORK/stoke/$name.stoke.json"
    done
    "$PY" benches/peers/hta_analyze.py "$FIXTURES"/*.json.gz >"$WORK/hta_fixtures.json" 2>/dev/null
else
    echo "fixtures missing: $FIXTURES" >&2
    exit 1
fi

if [ "$SYNTH_MB" -gt 0 ]; then
    synth="$WORK/synthetic"
    # Few long steps, as real multi-GB traces have (HTA's per-event step lookup is linear in the
    # number of steps, so thousands of short steps would exaggerate its cost).
    "$STOKE" trace gen-synthetic --out "$synth" --ranks 1 --mb "$SYNTH_MB" \
        --kernels-per-step "${SYNTH_KERNELS_PER_STEP:-50000}" 2>/dev/null
    f="$synth/rank-0.json"
    bytes=$(stat -c %s "$f")
    read -r sw sr sc < <(measure "$STOKE" trace analyze "$f" --format table)
    read -r aw ar ac < <(measure "$ALONE" "$f")
    read -r hw hr hc < <(measure "$PY" benches/peers/hta_analyze.py --quick "$f")
    report "synthetic $((bytes / 1000000)) MB (HTA: load + temporal only)" "$bytes" "$sw" "$sr" "$sc" "$aw" "$ar" "$ac" "$hw" "$hr" "$hc"
    rm -rf "$synth"
fi

if [ -f "$WORK/hta_fixtures.json" ]; then
    echo
    echo "### Numbers, stoke against HTA"
    "$PY" benches/peers/compare_hta.py "$WORK/stoke" "$WORK/hta_fixtures.json"
fi
