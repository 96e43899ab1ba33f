#!/usr/bin/env bash
# stoke.trace.analyze (the wheel, from Python) against the stoke-trace binary on one large trace:
# a PyTorch profiler fixture's events replicated end to end (steps, flows and correlation ids
# renumbered per copy) to about GB gigabytes in a temporary folder, deleted at the end.
# Interleaved rounds binary, Python, binary, ...; wall time of each whole process (the Python
# one includes the interpreter and `import stoke`), and the analyze call alone inside Python.
#
#   benches/py_trace.sh        # ROUNDS=5 GB=1; needs the wheel's environment from benches/py_loader.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ROUNDS=${ROUNDS:-5}
GB=${GB:-1}
VPY=${VPY:-target/py-bench/venv/bin/python}
BIN=${BIN:-target/release/stoke-trace}
[ -x "$BIN" ] || cargo build --release --quiet --bin stoke-trace
[ -x "$VPY" ] || { echo "no $VPY: run benches/py_loader.sh first (it makes the wheel's environment)"; exit 2; }
TMP=$(mktemp -d /tmp/stoke-py-trace.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
FIXTURE=crates/prof/tests/fixtures/traces/hta_ns_resolution_trace_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz

echo "== a ${GB} GB trace from $FIXTURE"
"$VPY" - "$FIXTURE" "$TMP/rank-0.json" "$GB" <<'PYEOF'
import gzip, json, sys
src, out, gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
trace = json.load(gzip.open(src))
events = trace.pop("traceEvents")
stamps = [float(e["ts"]) + float(e.get("dur", 0)) for e in events if "ts" in e]
span = max(stamps) - min(float(e["ts"]) for e in events if "ts" in e) + 1000.0
steps = [int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
n_steps = max(steps) - min(steps) + 1
one = sum(len(json.dumps(e)) + 2 for e in events)
copies = max(1, int(gb * 1e9 / one))
ID_STRIDE = 10**7
with open(out, "w") as f:
    f.write(json.dumps(trace)[:-1] + ', "traceEvents": [\n')
    first = True
    for k in range(copies):
        for e in events:
            if e.get("ph") == "M" and k > 0:
                continue
            e = dict(e)
            if "ts" in e:
                e["ts"] = round(float(e["ts"]) + k * span, 3)
            if "id" in e and isinstance(e["id"], int):
                e["id"] += k * ID_STRIDE
            name = e.get("name", "")
            if name.startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{int(name.split('#')[1]) + k * n_steps}"
            args = e.get("args")
            if isinstance(args, dict):
                args = dict(args)
                for key in ("correlation", "External id", "Ev Idx", "Record function id"):
                    if isinstance(args.get(key), int):
                        args[key] += k * ID_STRIDE
                e["args"] = args
            f.write(("" if first else ",\n") + json.dumps(e))
            first = False
    f.write("\n]}\n")
print(f"{copies} copies of {len(events)} events ({n_steps} steps each)")
PYEOF
ls -l "$TMP/rank-0.json"
cat "$TMP/rank-0.json" > /dev/null  # both sides read it from the page cache

cd "$TMP"  # `import stoke` can only be the installed wheel
: > times.txt
for round in $(seq "$ROUNDS"); do
  start=$(date +%s.%N)
  "$ROOT/$BIN" analyze rank-0.json --format json > bin.json
  end=$(date +%s.%N)
  echo "binary $(echo "$end - $start" | bc)" | tee -a times.txt
  start=$(date +%s.%N)
  "$ROOT/$VPY" -c '
import json, sys, time
t = time.perf_counter()
import stoke.trace
report = stoke.trace.analyze("rank-0.json")
print(f"call {time.perf_counter() - t:.3f}", file=sys.stderr)
json.dump(report, open("py.json", "w"))
' 2>> times.txt
  end=$(date +%s.%N)
  echo "python $(echo "$end - $start" | bc)" | tee -a times.txt
  tail -2 times.txt | head -1
done
"$ROOT/$VPY" - <<'PYEOF'
import json, statistics
assert json.load(open("py.json")) == json.load(open("bin.json")), "stoke.trace and stoke-trace disagree"
rows = [line.split() for line in open("times.txt")]
by = {}
for name, seconds in rows:
    by.setdefault(name, []).append(float(seconds))
for name, values in by.items():
    print(f"{name:7s} median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}) over {len(values)}")
ratios = [p / b for p, b in zip(by["python"], by["binary"])]
print(f"python / binary, per round: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
print("the analyses are equal")
PYEOF
