"""stoke train against PyTorch on the same GPT, data, batch, precision and optimizer, like with like,
from interleaved repeats. Run through `benches/train_vs_pytorch.sh` (which documents the arguments);
the standard library only, so it never imports torch itself.

Per preset and precision, each round runs five processes one after another (the order rotated by one
each round):

  S   stoke's defaults (`stoke train`, nothing changed but the shape, batch and steps)
  PC  the tuned PyTorch peer, torch.compile'd: the fastest attention variant (measured first, below),
      fused AdamW, glibc keeping freed memory
  PE  the same tuned peer, eager
  SO  stoke with everything of its own turned off: `stoke bench fullchain`'s naive settings
      (data.workers=0, train.fused_optimizer=false, train.host_memory=system), no fused kernels
      (train.fused_cross_entropy=off, train.fused_layer_norm=false, train.fused_softmax=false,
      train.fused_bias_gelu=false, train.fused_branches=false), a cast per weight
      (train.unit_casts=false, as autocast casts), the attention that plain PyTorch runs (SDPA in the autocast type: train.attention=bf16), no
      per-block monitors
  PP  plain PyTorch: eager, SDPA, PyTorch's default AdamW, the C allocator's defaults

and the ratios of median steady step times S/PC, S/PE and SO/PP are taken within the round; the table
gives each ratio's median over the rounds with its min and max. A step time below 1 means stoke is
faster. Both sides skip the same first steps (`prof.skip_steps` and the peer's `--skip`);
tokens/s = tokens per step / median steady step time on both sides.

Before the rounds, the attention variant of the tuned peer is chosen per preset and precision by the
same interleaving (eager and compiled separately): bf16 tries sdpa (bf16 SDPA under autocast),
sdpa-fp32, matmul (bf16 batched matmuls with a causal mask over the whole square) and matmul-blocked
(the same 128 queries at a time against only the keys at or before them: stoke's bf16-math with its
default `train.causal_block_rows`); fp32 tries sdpa and matmul.

The physical limit is measured in every round: `stoke bench limits` (fp32 and bf16 matmul peak
through libtorch, memcpy). MFU = the report's model FLOPs per token x tokens/s over the round's bf16
matmul peak, for every side (the same FLOP count).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Shape, micro-batch, steps and skipped steps per preset: sized so the whole script ends in about an
# hour on 2 cores; gpt2-124m is the slow one (about 1 TFLOP a step at micro-batch 2).
CELLS = {
    "tiny": dict(micro_batch=16, steps=30, skip=5),
    "small": dict(micro_batch=16, steps=14, skip=4),
    "gpt2-124m": dict(micro_batch=1, steps=5, skip=2),
}
SEQ_LEN = {"tiny": 128, "small": 256, "gpt2-124m": 1024}
ATTENTION_CHOICES = {"bf16": ["sdpa", "sdpa-fp32", "matmul", "matmul-blocked"], "fp32": ["sdpa", "matmul"]}
# stoke's train.attention for the all-off configuration: plain PyTorch's autocast runs SDPA in bf16.
ALL_OFF_ATTENTION = {"bf16": "bf16", "fp32": "auto"}


def all_off(precision):
    """stoke's settings with everything of its own turned off (the SO configuration)."""
    return ["data.workers=0", "train.fused_optimizer=false", "train.host_memory=system",
            "train.fused_cross_entropy=off", "train.fused_layer_norm=false", "train.fused_softmax=false",
            "train.fused_bias_gelu=false", "train.fused_branches=false", "train.unit_casts=false",
            f"train.attention={ALL_OFF_ATTENTION[precision]}", "train.monitor_every=0"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.corpus = self.out / "corpus.txt"
        self.env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str((self.out / "inductor-cache").resolve()))
        self.runs = []  # every run's figures, for the JSON file

    def run(self, cmd, what, env=None):
        # Above the 10 that other benchmarks here take: another real-time process at the same
        # priority on the same cores makes both many times slower (they take turns only when one
        # blocks); above it, the other one simply waits until this run ends.
        prio = ["chrt", "-f", "20"] if self.args.realtime else []
        if self.args.realtime:
            wait_for_other_realtime()
        start = time.perf_counter()
        proc = subprocess.run(prio + cmd, capture_output=True, text=True, env=env or self.env,
                              timeout=self.args.run_timeout)
        if proc.returncode != 0:
            raise SystemExit(f"train_vs_pytorch: {what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                             f"{proc.stderr[-3000:]}")
        return proc.stdout, time.perf_counter() - start

    def stoke(self, preset, precision, cell, name, overrides):
        run_dir = self.out / "runs"
        sets = [
            f"run.dir={json.dumps(str(run_dir))}", f"run.name={name}", f"model.preset={preset}",
            f"train.precision={precision}", f"train.steps={cell['steps']}", f"train.micro_batch={cell['micro_batch']}",
            f"prof.skip_steps={cell['skip']}", "ckpt.every=0", "ckpt.at_end=false", "prof.prometheus=false",
        ] + overrides
        cmd = [self.args.stoke, "train", "--quiet", "--data", str(self.corpus)]
        for s in sets:
            cmd += ["--set", s]
        if (run_dir / name).exists():
            subprocess.run(["rm", "-rf", str(run_dir / name)], check=True)
        _, wall = self.run(cmd, f"stoke {name}")
        report = json.loads((run_dir / name / "report.json").read_text())
        steps = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines() if line]
        steady = [s for s in steps if s["step"] > cell["skip"]]
        phases = sorted({p for s in steady for p in s.get("phases_ms", {})})
        return {
            "side": "stoke", "name": name, "step_ms": report["step_ms"], "tokens_per_s": report["tokens_per_s"],
            "step_ms_mean": report["step_ms_mean"], "step_ms_p90": report["step_ms_p90"],
            "step_ms_min": min(s["step_ms"] for s in steady),
            "steps_measured": report["steps_measured"],
            "phases_ms_median": {p: statistics.median(s["phases_ms"].get(p, 0.0) for s in steady) for p in phases},
            "phases_ms_mean": {p: statistics.fmean(s["phases_ms"].get(p, 0.0) for s in steady) for p in phases},
            "flops_per_token": report["model"]["flops_per_token"], "wall_s": wall,
            # Mean of the last 10 logged losses, as the peer and `stoke bench` take it.
            "final_loss": statistics.fmean(s["loss"] for s in steps[-10:]),
        }

    def peer(self, preset, precision, cell, name, flags):
        cmd = [self.args.python, "benches/peers/train_gpt.py", "--data", str(self.corpus), "--preset", preset,
               "--precision", precision, "--steps", str(cell["steps"]), "--micro-batch", str(cell["micro_batch"]),
               "--skip", str(cell["skip"])] + flags
        out, wall = self.run(cmd, f"peer {name}")
        v = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        v.update(side="pytorch", name=name, process_wall_s=wall)
        return v

    def limits(self, tag, preset, micro_batch):
        path = self.out / f"limits-{tag}.json"
        self.run([self.args.stoke, "bench", "limits", "--dir", str(self.out), "--bytes", str(256 << 20),
                  "--preset", preset, "--micro-batch", str(micro_batch), "--json", str(path)], "stoke bench limits")
        return json.loads(path.read_text())

    def pick_attention(self, preset, precision, cell):
        """The tuned peer's attention, eager and compiled: lowest median of the per-round step times
        (the rounds interleave the variants)."""
        picks = {}
        for mode in self.args.pick_modes.split(","):
            variants = ATTENTION_CHOICES[precision]
            times = {a: [] for a in variants}
            for round_idx in range(self.args.pick_rounds):
                for a in variants:
                    flags = ["--attention", a, "--adamw", "fused", "--host-memory", "retain"]
                    if mode == "compiled":
                        flags.append("--compile")
                    v = self.peer(preset, precision, cell, f"pick-{a}-{mode}", flags)
                    v.update(preset=preset, precision=precision, config=f"pick-{mode}", round=round_idx)
                    self.runs.append(v)
                    times[a].append(v["step_ms"])
                    log(f"  pick {preset} {precision} {mode} {a}: {v['step_ms']:.1f} ms")
            best = min(variants, key=lambda a: statistics.median(times[a]))
            picks[mode] = {"attention": best, "step_ms": {a: times[a] for a in variants}}
        if "compiled" not in picks:
            # Not measured compiled: the compiled peer takes the eager winner.
            picks["compiled"] = {"attention": picks["eager"]["attention"], "step_ms": "eager's winner"}
        return picks

    def cell(self, preset, precision):
        cell = self.cell_of(preset)
        picks = self.pick_attention(preset, precision, cell) if self.args.pick_rounds else {
            "eager": {"attention": self.args.attention}, "compiled": {"attention": self.args.attention}}
        tuned = ["--adamw", "fused", "--host-memory", "retain"]
        configs = [
            ("S", lambda n: self.stoke(preset, precision, cell, n, [])),
            ("PC", lambda n: self.peer(preset, precision, cell, n,
                                       tuned + ["--attention", picks["compiled"]["attention"], "--compile"])),
            ("PE", lambda n: self.peer(preset, precision, cell, n, tuned + ["--attention", picks["eager"]["attention"]])),
            ("SO", lambda n: self.stoke(preset, precision, cell, n, all_off(precision))),
            ("PP", lambda n: self.peer(preset, precision, cell, n,
                                       ["--attention", "sdpa", "--adamw", "default", "--host-memory", "system"])),
        ]
        rounds = self.rounds(preset, precision, configs, cell)
        return summarize(preset, precision, cell, picks, rounds)

    def rounds(self, preset, precision, configs, cell):
        rounds = []
        for round_idx in range(self.args.rounds):
            limits = self.limits(f"{preset}-{precision}-{round_idx}", preset, cell["micro_batch"])
            got = {"limits": limits}
            # The order rotates by one each round, so no side is always first (step_changes.sh found
            # a pair's second run about 5% slower than its first on gpt2-124m).
            shift = round_idx % len(configs)
            for config, fn in configs[shift:] + configs[:shift]:
                for attempt in range(3):
                    v = fn(f"{preset}-{precision}-{config}-{round_idx}")
                    if not disturbed(v):
                        break
                    log(f"  {config} disturbed (median {v['step_ms']:.1f} ms, p90 {v['step_ms_p90']:.1f} ms): again")
                v["attempts"] = attempt + 1
                v.update(preset=preset, precision=precision, config=config, round=round_idx)
                self.runs.append(v)
                got[config] = v
                log(f"  {preset} {precision} round {round_idx} {config}: {v['step_ms']:.1f} ms")
            rounds.append(got)
        return rounds

    def ablation(self, preset, precision):
        """Where stoke all-off's step differs from plain PyTorch's: the two, and each with one
        thing changed, interleaved; every ratio is over plain PyTorch in the same round."""
        cell = self.cell_of(preset)
        off = all_off(precision)
        plain = ["--attention", "sdpa", "--adamw", "default"]
        configs = [
            ("PP", lambda n: self.peer(preset, precision, cell, n, plain + ["--host-memory", "system"])),
            ("SO", lambda n: self.stoke(preset, precision, cell, n, off)),
            ("SO+single-graph", lambda n: self.stoke(preset, precision, cell, n, off + ["train.executor=single-graph"])),
            ("SO+retain", lambda n: self.stoke(preset, precision, cell, n, off + ["train.host_memory=retain"])),
            ("SO+unit-casts", lambda n: self.stoke(preset, precision, cell, n, off + ["train.unit_casts=true"])),
            ("PP+retain", lambda n: self.peer(preset, precision, cell, n, plain + ["--host-memory", "retain"])),
        ]
        rounds = self.rounds(preset, precision, configs, cell)
        names = [c for c, _ in configs]
        out = {"preset": preset, "precision": precision, **cell,
               "step_ms": {c: spread([r[c]["step_ms"] for r in rounds]) for c in names},
               "over_PP": {c: spread([r[c]["step_ms"] / r["PP"]["step_ms"] for r in rounds]) for c in names[1:]},
               "phases_ms_median": {c: {p: statistics.median(r[c]["phases_ms_median"].get(p, 0.0) for r in rounds)
                                        for p in rounds[0][c]["phases_ms_median"]} for c in names}}
        print(f"\nablation {preset} {precision} (micro-batch {cell['micro_batch']}), step time over plain PyTorch's, "
              f"median [min, max] of {len(rounds)} rounds")
        for c in names:
            ratio = fmt(out["over_PP"][c]) if c in out["over_PP"] else "1"
            phases = ", ".join(f"{p} {v:.1f}" for p, v in out["phases_ms_median"][c].items() if v >= 0.05)
            print(f"  {c:<16} {out['step_ms'][c]['median']:8.1f} ms  {ratio:<24} {phases}")
        return out

    def cell_of(self, preset):
        cell = dict(CELLS[preset])
        for key in ("micro_batch", "steps", "skip"):
            if getattr(self.args, key):
                cell[key] = getattr(self.args, key)
        return cell


def other_realtime_processes():
    """User processes under a real-time scheduling class (another benchmark under `chrt`): two such
    processes on the same cores take turns only when one blocks, which makes both many times
    slower."""
    out = subprocess.run(["ps", "-eo", "pid=,cls=,comm="], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        pid, cls, comm = (line.split(None, 2) + [""])[:3]
        if cls in ("FF", "RR") and os.path.exists(f"/proc/{pid}/exe") and os.readlink(f"/proc/{pid}/exe"):
            found.append(f"{pid} {comm}")
    return found


def wait_for_other_realtime(limit_s=3):
    """Lets another real-time benchmark's run end first (for up to `limit_s`), so as not to freeze it."""
    start = time.perf_counter()
    while (found := other_realtime_processes()) and time.perf_counter() - start < limit_s:
        time.sleep(0.5)
    if found:
        log(f"  another real-time process runs ({', '.join(found)}); this run takes the cores first")


def disturbed(v):
    """A run whose slow steps are far from its median: something else took the cores for part of it."""
    return v["step_ms_p90"] > 2.0 * v["step_ms"]


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(preset, precision, cell, picks, rounds):
    ratio = lambda a, b: spread([r[a]["step_ms"] / r[b]["step_ms"] for r in rounds])
    # The same ratios of each run's fastest steady step: a machine whose speed flips between runs
    # (2026-12-03: a run's steps at either of two levels, 20% apart) moves the medians' ratio more.
    fastest = lambda a, b: spread([r[a]["step_ms_min"] / r[b]["step_ms_min"] for r in rounds])
    step = lambda c: spread([r[c]["step_ms"] for r in rounds])
    peak = spread([r["limits"]["matmul_bf16_flops"] for r in rounds])
    fpt = rounds[0]["S"]["flops_per_token"]
    tokens = cell["micro_batch"] * SEQ_LEN[preset]
    mfu = lambda c: spread([fpt * tokens / (r[c]["step_ms"] / 1e3) / r["limits"]["matmul_bf16_flops"]
                            for r in rounds])
    phase_cmp = {}
    for a, b in (("SO", "PP"), ("S", "PE")):
        phases = sorted(set(rounds[0][a]["phases_ms_median"]) | set(rounds[0][b]["phases_ms_median"]))
        phase_cmp[f"{a}-{b}"] = {
            p: {a: statistics.median(r[a]["phases_ms_median"].get(p, 0.0) for r in rounds),
                b: statistics.median(r[b]["phases_ms_median"].get(p, 0.0) for r in rounds)} for p in phases}
    return {
        "preset": preset, "precision": precision, **cell, "tokens_per_step": tokens,
        "attention": {m: picks[m]["attention"] for m in picks}, "attention_pick": picks,
        "S/PC": ratio("S", "PC"), "S/PE": ratio("S", "PE"), "SO/PP": ratio("SO", "PP"),
        "fastest_step": {"S/PC": fastest("S", "PC"), "S/PE": fastest("S", "PE"), "SO/PP": fastest("SO", "PP")},
        "step_ms": {c: step(c) for c in ("S", "PC", "PE", "SO", "PP")},
        "compile_s": spread([r["PC"]["compile_s"] for r in rounds]),
        "peer_wall_s": {c: spread([r[c]["wall_s"] for r in rounds]) for c in ("PC", "PE")},
        "matmul_bf16_peak_flops": peak,
        "matmul_fp32_peak_flops": spread([r["limits"]["matmul_fp32_flops"] for r in rounds]),
        "mfu_bf16_peak": {c: mfu(c) for c in ("S", "PC", "PE")},
        # The step's bf16 matrix multiplies alone at the model's shapes (whole causal square), over
        # each side's step in the same round: no side that runs those products through libtorch
        # can go below this share of its own step; the ratio over the compiled peer is the lowest
        # stoke / compiled that leaving only the matrix multiplies would give.
        "model_gemm_ms": spread([r["limits"]["model_gemm_ms"] for r in rounds]),
        "gemm_over_step": {c: spread([r["limits"]["model_gemm_ms"] / r[c]["step_ms"] for r in rounds])
                           for c in ("S", "PC", "PE")},
        "phases_ms_median": phase_cmp,
        "final_loss": {c: statistics.median(r[c]["final_loss"] for r in rounds) for c in ("S", "PC", "PE", "SO", "PP")},
    }


def fmt(s, digits=3):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(cells):
    print("\nstep time ratios, median [min, max] over the rounds (below 1: stoke faster)\n")
    print("| preset | precision | micro-batch | tuned attention (compiled / eager) | stoke / tuned compiled "
          "| stoke / tuned eager | stoke all-off / plain PyTorch | step ms: S, PC, PE, SO, PP |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        steps = ", ".join(f"{c['step_ms'][k]['median']:.0f}" for k in ("S", "PC", "PE", "SO", "PP"))
        print(f"| {c['preset']} | {c['precision']} | {c['micro_batch']} | {c['attention']['compiled']} / "
              f"{c['attention']['eager']} | {fmt(c['S/PC'])} | {fmt(c['S/PE'])} | {fmt(c['SO/PP'])} | {steps} |")
    print("\nthe same ratios of each run's fastest steady step\n")
    print("| preset | precision | stoke / tuned compiled | stoke / tuned eager | stoke all-off / plain PyTorch |")
    print("|---|---|---|---|---|")
    for c in cells:
        f = c["fastest_step"]
        print(f"| {c['preset']} | {c['precision']} | {fmt(f['S/PC'])} | {fmt(f['S/PE'])} | {fmt(f['SO/PP'])} |")
    print("\nMFU against the bf16 matmul peak measured in the same rounds; compile time of the compiled peer;\n"
          "the step's bf16 matrix multiplies alone (whole causal square) and their share of each side's step\n")
    print("| preset | precision | bf16 peak GFLOP/s | MFU stoke | MFU tuned compiled | MFU tuned eager | compile s "
          "| matmuls alone ms | over stoke's step | over compiled's step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        m = c["mfu_bf16_peak"]
        peak = {k: v / 1e9 for k, v in c["matmul_bf16_peak_flops"].items() if k != "n"}
        g = c["gemm_over_step"]
        print(f"| {c['preset']} | {c['precision']} | {fmt(peak, 0)} | {fmt(m['S'])} | {fmt(m['PC'])} | "
              f"{fmt(m['PE'])} | {fmt(c['compile_s'], 1)} | {fmt(c['model_gemm_ms'], 1)} | {fmt(g['S'])} | "
              f"{fmt(g['PC'])} |")
    print("\nphases, ms (median step's phase, median over the rounds)\n")
    for c in cells:
        for pair, phases in c["phases_ms_median"].items():
            a, b = pair.split("-")
            row = ", ".join(f"{p} {v[a]:.1f}/{v[b]:.1f}" for p, v in phases.items() if v[a] or v[b])
            print(f"{c['preset']} {c['precision']} {a}/{b}: {row}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pick-rounds", type=int, default=2,
                    help="interleaved rounds choosing the tuned peer's attention; 0 takes --attention")
    ap.add_argument("--attention", default="matmul-blocked")
    ap.add_argument("--pick-modes", default="eager,compiled",
                    help="eager,compiled: pick the attention for each; eager: the compiled peer takes eager's pick")
    ap.add_argument("--presets", default="tiny,small,gpt2-124m")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--out", default="runs/train-vs-pytorch")
    ap.add_argument("--stoke", default="target/release/stoke")
    ap.add_argument("--python", default=".stoke/venv/bin/python")
    ap.add_argument("--micro-batch", type=int, default=0, help="instead of the preset's (CELLS)")
    ap.add_argument("--steps", type=int, default=0, help="instead of the preset's (CELLS)")
    ap.add_argument("--skip", type=int, default=0, help="instead of the preset's (CELLS)")
    ap.add_argument("--ablation", action="store_true",
                    help="instead of the table: stoke all-off and plain PyTorch with one thing changed at a time")
    ap.add_argument("--realtime", action="store_true", help="run every process under chrt -f 20")
    ap.add_argument("--run-timeout", type=float, default=1800)
    args = ap.parse_args()
    bench = Bench(args)
    bench.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([args.stoke, "corpus", "--out", str(bench.corpus)], check=True, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cells = []
    for preset in args.presets.split(","):
        for precision in args.precisions.split(","):
            log(f"{preset} {precision}")
            cells.append(bench.ablation(preset, precision) if args.ablation else bench.cell(preset, precision))
            # Written after every cell, so a long run leaves what it has measured.
            (bench.out / "summary.json").write_text(json.dumps(
                {"commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()), "cells": cells,
                 "runs": bench.runs}, indent=1))
    if not args.ablation:
        print_table(cells)
    print(f"\ncommit {commit}; every run's figures: {bench.out / 'summary.json'}")


if __name__ == "__main__":
    main()
