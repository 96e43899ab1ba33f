"""Compares `stoke trace analyze --json` with hta_analyze.py on the same files, analysis by
analysis, and prints a Markdown table per file (used for benches/TRACE_VS_HTA.md).

usage: compare_hta.py STOKE_DIR HTA_JSON
  STOKE_DIR holds one `<file name>.stoke.json` per trace; HTA_JSON is hta_analyze.py's output.
"""

import json
import os
import sys


def us(ns):
    return ns / 1000.0


def row(name, ours, theirs):
    if theirs is None or ours is None:
        return f"| {name} | {ours} | {theirs} | |"
    diff = ours - theirs
    rel = f"{100.0 * diff / theirs:+.2f}%" if theirs else ("0" if diff == 0 else "n/a")
    return f"| {name} | {ours:,.1f} | {theirs:,.1f} | {diff:+,.1f} ({rel}) |"


def main(stoke_dir, hta_json):
    hta = json.load(open(hta_json))
    for path, h in hta.items():
        base = os.path.basename(path)
        s = json.load(open(os.path.join(stoke_dir, base + ".stoke.json")))
        r = s["ranks"][0]
        print(f"\n#### `{base}`\n")
        print("| figure (us unless noted) | stoke | HTA | stoke - HTA |\n|---|---:|---:|---:|")
        t = h["temporal"][0] if isinstance(h["temporal"], list) else None
        g = r["gpu"]
        if t:
            print(row("GPU span (HTA kernel_time)", us(g["span_ns"]), t["kernel_time(us)"]))
            print(row("GPU idle", us(g["idle_ns"]), t["idle_time(us)"]))
            print(row("compute", us(g["compute_ns"]), t["compute_time(us)"]))
            print(row("non-compute", us(g["non_compute_ns"]), t["non_compute_time(us)"]))
        idle = h.get("idle")
        if isinstance(idle, dict) and "error" not in idle:
            for cat, key in (("host_wait", "host_wait_ns"), ("kernel_wait", "kernel_wait_ns"), ("other", "other_ns")):
                theirs = sum(x["idle_time"] for x in idle["0"] if x["idle_category"] == cat)
                ours = sum(us(x[key]) for x in r["idle_by_stream"])
                print(row(f"idle {cat}, all streams", ours, theirs))
        elif isinstance(idle, dict):
            print(f"| idle breakdown | | {idle['error'][:60]} | |")
        k = h.get("kernels")
        if isinstance(k, dict) and "top" in k:
            # HTA lists the top kernels of each type plus an "others" bucket; compare the kernels
            # that both list under the same name.
            theirs = {x["name"]: x["sum (us)"] for x in k["top"] if x["name"] != "others"}
            for kernel in r["top_kernels"][:3]:
                if kernel["name"] in theirs:
                    label = kernel["name"][:40].replace("|", "\\|")
                    print(row(f"kernel total: `{label}`", us(kernel["total_ns"]), theirs[kernel["name"]]))
        o = h.get("overlap")
        if isinstance(o, list) and o and r["overlap"]["overlap_ratio"] is not None:
            print(row("comm/compute overlap %", 100 * r["overlap"]["overlap_ratio"], o[0]["comp_comm_overlap_pctg"]))
        la = h.get("launches")
        if isinstance(la, dict) and "0" in la:
            print(row("launches (count)", r["launches"]["launch_delay"]["count"], la["0"]["count"]))
            if la["0"]["launch_delay_mean"] is not None:
                print(row("launch delay mean", r["launches"]["launch_delay"]["mean_ns"] / 1000, la["0"]["launch_delay_mean"]))
                print(row("launch delay outliers (count)", r["launches"]["launch_delay_outliers"], la["0"]["launch_delay_outliers"]))
        q = h.get("queue")
        if isinstance(q, list):
            theirs = {x["('stream', '')"]: x["('queue_length', 'max')"] for x in q}
            for qs in r["queue"]:
                if qs["stream"] in theirs:
                    print(row(f"max queue length, stream {qs['stream']} (count)", qs["max"], theirs[qs["stream"]]))
        print(f"| load + analyses (s) | | {h['load_s'] + h['analyses_s']:.2f} | |")
        steps = r["steps"]
        worst = max(abs(sum(st["categories"].values()) - st["wall_ns"]) for st in steps)
        print(f"\nSteps: {len(steps)}; largest |sum of categories - wall| = {worst} ns.")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
