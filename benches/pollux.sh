#!/usr/bin/env bash
# stoke's scheduling policies on Pollux's own workloads (OSDI'21 artifact, 8 workloads at load 1.0,
# 16 nodes x 4 GPUs) against the artifact's published per-workload mean completion times.
#
# Usage: benches/pollux.sh ARTIFACT_SIMULATOR_DIR [OUT_DIR] [extra `stoke sched simulate` flags]
#   ARTIFACT_SIMULATOR_DIR: the simulator/ folder of a checkout of petuum/adaptdl, branch
#   osdi21-artifact (nothing is fetched). OUT_DIR defaults to runs/pollux.
# Needs: python3 (standard library only), a built `stoke` (STOKE=path, default target/release/stoke).
set -euo pipefail
sim_dir=${1:?usage: benches/pollux.sh ARTIFACT_SIMULATOR_DIR [OUT_DIR] [flags]}
out=${2:-runs/pollux}
shift $(( $# >= 2 ? 2 : 1 ))
stoke=${STOKE:-target/release/stoke}
policies=${POLICIES:-fifo,fair,goodput,tiresias,optimus}
here=$(cd "$(dirname "$0")" && pwd)

python3 "$here/pollux_convert.py" "$sim_dir" "$out/jobs"
for n in 1 2 3 4 5 6 7 8; do
  "$stoke" sched simulate --jobs "$out/jobs/workload-$n.csv" --slots 64 --tick-s 60 \
    --policy "$policies" --out "$out/workload-$n" "$@" > "$out/workload-$n.txt"
done
# Fidelity: each application alone on the GPUs and batch it asks for, against the traces.
"$stoke" sched simulate --jobs "$out/jobs/single.csv" --slots 64 --policy fifo --out "$out/single" > /dev/null

python3 - "$sim_dir" "$out" "$policies" <<'EOF'
import json, os, sys
sim_dir, out, policies = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
def published(name):
    path = os.path.join(sim_dir, "results-jobload", f"{name}-1.0", "summary.json")
    return json.load(open(path))["avgs"]
pollux, tiresias, optimus = published("pollux"), published("tiresias"), published("optimus")
rows = {}
for n in range(1, 9):
    figures = json.load(open(os.path.join(out, f"workload-{n}", "figures.json")))
    rows[n] = {f["policy"]: f["figures"]["mean_completion_s"] for f in figures}
head = "workload " + " ".join(f"{p:>9}" for p in policies) + "   Pollux* Tiresias* Optimus*  goodput/Pollux*"
print(head)
for n in range(1, 9):
    key = f"workload-{n}"
    line = f"{n:>8} " + " ".join(f"{rows[n][p]:>9.0f}" for p in policies)
    ratio = rows[n].get("goodput", float("nan")) / pollux[key]
    print(line + f" {pollux[key]:>9.0f} {tiresias[key]:>9.0f} {optimus[key]:>8.0f}  {ratio:>8.3f}")
mean = {p: sum(rows[n][p] for n in rows) / 8 for p in policies}
pub = lambda d: sum(d[f"workload-{n}"] for n in range(1, 9)) / 8
print("    mean " + " ".join(f"{mean[p]:>9.0f}" for p in policies)
      + f" {pub(pollux):>9.0f} {pub(tiresias):>9.0f} {pub(optimus):>8.0f}  "
      + f"{mean.get('goodput', float('nan')) / pub(pollux):>8.3f}")
print("* published by the artifact (results-jobload/<policy>-1.0/summary.json)")
if "goodput" in mean and "fair" in mean:
    worse = [n for n in rows if rows[n]["goodput"] > rows[n]["fair"]]
    print(f"goodput worse than fair on workloads: {worse or 'none'}")
expected = json.load(open(os.path.join(out, "jobs", "single.json")))
alone = json.load(open(os.path.join(out, "single", "jobs-single-fifo.json")))["jobs"]
print("fidelity, each application alone (stoke's completion over the traces' time):")
for job in alone:
    e = expected[job["name"]]
    print(f"  {job['name']:<18} {e['gpus']} GPUs batch {e['batch']:>6}: stoke {job['completion_s']:>9.0f} s, "
          f"traces {e['trace_s']:>9.0f} s, ratio {job['completion_s'] / e['trace_s']:.4f}")
EOF
