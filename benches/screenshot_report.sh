#!/usr/bin/env bash
# Renders a run's report.html in headless Chromium and saves a screenshot, to check that the page
# and its plots render without a browser session.
#
#   benches/screenshot_report.sh [RUN_DIR] [OUT_PNG]
#
# Without RUN_DIR it trains a short run of the default model first (runs/screenshot-<time>/).
# Needs `chromium` (Debian: apt-get install -y chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir="${1:-}"
if [[ -z "$run_dir" ]]; then
  name="screenshot-$(date -u +%Y%m%d-%H%M%S)"
  cargo build --release --bin stoke
  ./target/release/stoke train --quiet --set run.name="$name" --set train.steps=120 --set prof.prometheus=false
  run_dir="runs/$name"
fi
out="${2:-$run_dir/report.png}"
profile_dir="$(mktemp -d)"
trap 'rm -rf "$profile_dir"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --user-data-dir="$profile_dir" --hide-scrollbars \
  --screenshot="$(realpath -m "$out")" --window-size=1200,1600 "file://$(realpath "$run_dir/report.html")"
echo "screenshot: $out"
