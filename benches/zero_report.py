"""benches/zero.sh's parsing and table, in one place.

    zero_report.py stoke REPORT_JSON WORLD STAGE PAIR   one JSON line for a `stoke launch ... train` run
    zero_report.py peer WORLD SHARDING PAIR < LINE       one JSON line for fsdp_gpt.py's output
    zero_report.py table RUNS_JSONL FORMULA_JSON...      the table (formula files: `stoke plan --zero-table --json`)

The names report.json uses are the constants below; nothing else in the benchmark reads report.json.
"""
import json
import statistics
import sys

# report.json: per rank, its model-state bytes (the trainer's formula: parameters, gradients, optimizer,
# comm_buffers) and its measured peak resident set in one list; its step time in the ranks' summaries.
MEMORY = ("ranks", "memory")
SUMMARIES = ("ranks", "ranks")
RANK_ID = "rank"
STAGE = "zero"
CATEGORIES = ("parameters", "gradients", "optimizer", "comm_buffers")
PEAK_RSS = "peak_rss_bytes"
RSS_START = "rss_start_bytes"
STEP_MS = "step_ms"

MIB = 1024 * 1024


def dig(obj, path, where):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            sys.exit(f"zero_report: {where} has no {'.'.join(path)} (stopped at {key!r})")
        obj = obj[key]
    return obj


def stoke_line(path, world, stage, pair):
    with open(path) as f:
        report = json.load(f)
    steps = {entry[RANK_ID]: entry[STEP_MS] for entry in dig(report, SUMMARIES, path)}
    ranks = []
    for entry in dig(report, MEMORY, path):
        where = f"{path} {'.'.join(MEMORY)} rank {entry.get(RANK_ID)}"
        if dig(entry, (STAGE,), where) != stage:
            sys.exit(f"zero_report: {where} ran ZeRO stage {entry[STAGE]}, expected {stage}")
        peak = dig(entry, (PEAK_RSS,), where)
        if peak is None:
            sys.exit(f"zero_report: {where} has no measured {PEAK_RSS} (/proc/self/clear_refs unavailable?)")
        ranks.append({
            "rank": entry[RANK_ID],
            "peak_rss_bytes": peak,
            "rss_start_bytes": entry.get(RSS_START),
            "memory": {c: dig(entry, (c,), where) for c in CATEGORIES},
            "step_ms": steps.get(entry[RANK_ID]),
        })
    if len(ranks) != world:
        sys.exit(f"zero_report: {path} reports the memory of {len(ranks)} ranks, expected {world}")
    return {"kind": "stoke", "world": world, "variant": f"zero{stage}", "stage": stage, "pair": pair,
            "step_ms": max(steps.values()), "ranks": ranks}


def peer_line(text, world, sharding, pair):
    d = json.loads(text)
    if d["world_size"] != world:
        sys.exit(f"zero_report: the FSDP peer ran {d['world_size']} ranks, expected {world}")
    ranks = [{"rank": r["rank"], "peak_rss_bytes": r["peak_rss_bytes"], "model_states": r["model_states_total"],
              "step_ms": r["step_ms"]} for r in d["ranks"]]
    api = "fsdp2" if d.get("api") == "fsdp2" else "fsdp"
    return {"kind": "peer", "world": world, "variant": f"{api}-{sharding}", "pair": pair, "step_ms": d["step_ms"],
            "ranks": ranks, "final_loss": d["final_loss"]}


def spread(values):
    return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"


def formula_totals(formulas, world, stage):
    """Per rank: (peak total, between-steps total) from `stoke plan --zero-table --json`."""
    for stage_entry in formulas[world]["stages"]:
        if stage_entry["stage"] == stage:
            return {r["rank"]: (r["total"], r["between_steps_total"]) for r in stage_entry["ranks"]}
    sys.exit(f"zero_report: the formula for world {world} has no stage {stage}")


def table(runs_path, formula_paths):
    formulas = {}
    for path in formula_paths:
        with open(path) as f:
            data = json.load(f)
        formulas[data["world"]] = data
    runs = [json.loads(line) for line in open(runs_path) if line.strip()]
    by = {}
    for run in runs:
        by.setdefault((run["world"], run["variant"]), {})[run["pair"]] = run
    worlds = sorted({w for w, _ in by})
    out = []
    for world in worlds:
        base = by.get((world, "zero0"), {})
        n_pairs = max(len(p) for (w, _), p in by.items() if w == world)
        out.append(f"\n{world} processes (median [min, max] over {n_pairs} interleaved pairs; MiB per rank, "
                   f"the rank with the most):")
        out.append(f"  {'variant':<20} {'peak RSS':>26} {'formula peak':>13} {'report':>9} {'saved vs 0':>26} "
                   f"{'formula saved':>13} {'saved/formula':>13} {'step ms':>26} {'step / zero0':>22}")
        for variant in sorted(v for w, v in by if w == world):
            pairs = by[(world, variant)]
            rss = [max(r["peak_rss_bytes"] for r in run["ranks"]) / MIB for run in pairs.values()]
            steps = [run["step_ms"] for run in pairs.values()]
            common = [p for p in pairs if p in base]
            over0 = [pairs[p]["step_ms"] / base[p]["step_ms"] for p in common]
            # The saving against stoke's own stage 0 (not across programs: a peer's libraries differ).
            saved = [(max(r["peak_rss_bytes"] for r in base[p]["ranks"])
                      - max(r["peak_rss_bytes"] for r in pairs[p]["ranks"])) / MIB
                     for p in common if pairs[p]["kind"] == "stoke"]
            formula = report = saved_formula = ratio = "-"
            run0 = next(iter(pairs.values()))
            if run0["kind"] == "stoke":
                stage = run0["stage"]
                totals = formula_totals(formulas, world, stage)
                peak = max(t[0] for t in totals.values())
                formula = f"{peak / MIB:.1f}"
                reported = [sum(r["memory"].values()) for run in pairs.values() for r in run["ranks"]]
                report = f"{max(reported) / MIB:.1f}"
                # The report's bytes are the formula's (one function): anything else is a defect.
                mismatched = [(run["pair"], r["rank"]) for run in pairs.values() for r in run["ranks"]
                              if sum(r["memory"].values()) not in totals[r["rank"]]]
                if mismatched:
                    report += "!"
                    out.append(f"  note: {variant}: report.json's memory differs from `stoke plan --zero-table` for "
                               f"(pair, rank) {mismatched}")
                peak0 = max(t[0] for t in formula_totals(formulas, world, 0).values())
                saved_formula = f"{(peak0 - peak) / MIB:.1f}"
                if stage != 0 and peak0 != peak:
                    ratios = [s / ((peak0 - peak) / MIB) for s in saved]
                    within = all(abs(x - 1) <= 0.05 for x in ratios)
                    ratio = f"{statistics.median(ratios):.3f}{'' if within else '*'}"
            else:
                fsdp_states = max(r["model_states"] for run in pairs.values() for r in run["ranks"])
                formula = f"({fsdp_states / MIB:.1f})"
            out.append(f"  {variant:<20} {spread(rss):>26} {formula:>13} {report:>9} "
                       f"{spread(saved) if saved else '-':>26} {saved_formula:>13} {ratio:>13} {spread(steps):>26} "
                       f"{(f'{statistics.median(over0):.3f} [{min(over0):.3f}, {max(over0):.3f}]') if over0 else '-':>22}")
    out.append("\nformula peak: `stoke plan --zero-table` (stoke_plan::zero_rank_bytes) with the in-flight units the "
               "run used; report: report.json's per-rank memory (must equal the formula: '!' when not);\n"
               "saved vs 0: peak RSS of the same pair's zero0 run minus this run's; saved/formula: that over the "
               "formula's saving ('*': outside 5% in some pair);\n"
               "FSDP rows: (model states FSDP holds at a step's end, counted from its tensors) in the formula column.")
    print("\n".join(out))


def main():
    cmd = sys.argv[1]
    if cmd == "stoke":
        path, world, stage, pair = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(stoke_line(path, world, stage, pair)))
    elif cmd == "peer":
        world, sharding, pair = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
        print(json.dumps(peer_line(sys.stdin.read(), world, sharding, pair)))
    elif cmd == "table":
        table(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"zero_report: unknown command {cmd!r}")


if __name__ == "__main__":
    main()
