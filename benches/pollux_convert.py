#!/usr/bin/env python3
"""Converts the Pollux artifact's simulator workloads and traces into `stoke sched simulate` job lists.

Usage: pollux_convert.py ARTIFACT_SIMULATOR_DIR OUT_DIR [--workloads workloads]

ARTIFACT_SIMULATOR_DIR is the `simulator/` folder of a checkout of petuum/adaptdl at its
`osdi21-artifact` branch (Qiao et al., "Pollux", OSDI 2021). Nothing is fetched: the script reads
that folder and writes, into OUT_DIR, one jobs CSV per workload (`workload-N.csv`), a CSV of one
job per application alone (`single.csv`, for the fidelity check) and `single.json` with each
single job's completion time computed from the traces directly.

What is read (the artifact's data, not its code):
- `traces/<app>/placements.csv`: step and sync seconds per (placement, local batch) on up to 4
  nodes of 4 GPUs; `traces/<app>/scalability.csv`: the same per (nodes, GPUs) on more nodes;
- `traces/<app>/validation-<B>.csv`: per epoch, progress (in steps of the least batch), the
  gradient's squared norm and variance, measured training at global batch B;
- `workloads/workload-N.csv`: name, submission time, application, GPUs and batch asked for.

How a job becomes a stoke job (stoke's model, batch.rs): work = least batch x the progress at the
end of the application's last epoch (its epoch counts: bert 2, cifar10 100, ncf 10, imagenet 90,
deepspeech2 80, yolov3 50, as the paper trains them); the noise scale of epoch e at each measured
batch, from the fraction of work where e starts, is b0 x var / sqr of that batch's statistics, which
turns the trace's gain (var + sqr) / (var / s + sqr) into McCandlish's efficiency (stoke
interpolates the noise scale between measured batches, where the artifact interpolates var and sqr);
the step table holds the packed placement (GPUs filling 4 per node) of 1..16 GPUs and of 24, 32, 48
and 64 (the scalability rows with that many nodes), at every local batch measured, and as many
spread placements (more nodes than the GPUs need) as the traces measure, for `--slots-per-node`;
batches accepted run from the least to the largest measured (ncf: 32768 alone, as the artifact fixes
it), micro-batches up to the largest measured (yolov3: 8); at most 64 GPUs and never a local batch
below the least measured (ncf: one GPU, as the artifact has it); 30 s for every start and resize, as
the artifact charges.
"""

import csv
import json
import math
import os
import sys

EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
MICRO_MAX = {"yolov3": 8}
FIXED_BATCH = {"ncf": 32768}
MAX_GPUS = {"ncf": 1}
RESTART_S = 30
GPUS_PER_NODE = 4
WORKERS = list(range(1, 17)) + [24, 32, 48, 64]


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def interp(xs, ys, x):
    """Linear interpolation of ys over sorted xs; None outside them."""
    if x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return None
    for i in range(len(xs) - 1):
        if x <= xs[i + 1]:
            f = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + f * (ys[i + 1] - ys[i])
    return ys[-1]


class App:
    def __init__(self, trace_dir, name):
        self.name = name
        self.validation = {}
        for entry in os.listdir(trace_dir):
            if entry.startswith("validation-") and entry.endswith(".csv"):
                batch = int(entry[len("validation-"):-len(".csv")])
                rows = read_rows(os.path.join(trace_dir, entry))
                self.validation[batch] = [{k: float(v) for k, v in r.items()} for r in rows]
        self.batches = sorted(self.validation)
        self.b0 = self.batches[0]
        self.batch_max = self.batches[-1]
        self.epochs = EPOCHS[name]
        placements = read_rows(os.path.join(trace_dir, "placements.csv"))
        self.steps = {}  # placement id -> sorted [(local, step, sync)]
        for r in placements:
            self.steps.setdefault(r["placement"], []).append(
                (float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])))
        for rows in self.steps.values():
            rows.sort()
        self.scalability = {}  # (nodes, gpus) -> sorted [(local, step, sync)]
        for r in read_rows(os.path.join(trace_dir, "scalability.csv")):
            key = (int(r["num_nodes"]), int(r["num_replicas"]))
            self.scalability.setdefault(key, []).append(
                (float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])))
        for rows in self.scalability.values():
            rows.sort()
        self.locals = sorted({float(r["local_bsz"]) for r in placements})
        self.micro_max = MICRO_MAX.get(name, self.locals[-1])
        self.locals = [m for m in self.locals if m <= self.micro_max]

    def progress(self, epoch):
        """Progress (steps of the least batch) at the end of `epoch` epochs: the least over batches."""
        if epoch == 0:
            return 0.0
        return min(rows[epoch - 1]["progress"] for rows in self.validation.values())

    def grad_stats(self, batch, epoch):
        xs = self.batches
        b = min(max(batch, xs[0]), xs[-1])
        sqr = interp(xs, [self.validation[x][epoch]["grad_sqr"] for x in xs], b)
        var = interp(xs, [self.validation[x][epoch]["grad_var"] for x in xs], b)
        return sqr, var

    def packed_rows(self, gpus):
        """(local, step, sync) rows of `gpus` GPUs filling nodes 4 at a time, or None."""
        placement = []
        while sum(placement) < gpus:
            placement.append(min(gpus - sum(placement), GPUS_PER_NODE))
        rotations = [placement[i:] + placement[:i] for i in range(len(placement))]
        key = "".join(map(str, min(rotations)))
        if key in self.steps:
            return self.steps[key]
        return self.scalability.get((len(placement), gpus))

    def step(self, gpus, micro):
        rows = self.packed_rows(gpus)
        if rows is None:
            return None
        xs = [r[0] for r in rows]
        step = interp(xs, [r[1] for r in rows], micro)
        sync = interp(xs, [r[2] for r in rows], micro)
        return None if step is None else (step, min(sync, step * 0.999))

    def max_gpus(self):
        return min(64, MAX_GPUS.get(self.name, 64), int(self.batch_max // self.locals[0]))


def spread_rows(app, gpus, nodes):
    """(local, step, sync) rows of `gpus` GPUs on `nodes` nodes (more than they fit on): on up to 4
    nodes the placement filling the first nodes, one GPU on each of the rest; on more, the
    scalability rows of that many nodes and GPUs; None where not measured."""
    if nodes <= 4:
        placement = [1] * nodes
        for i in range(nodes):
            add = min(GPUS_PER_NODE - 1, gpus - sum(placement))
            placement[i] += add
        rotations = [placement[i:] + placement[:i] for i in range(len(placement))]
        return app.steps.get("".join(map(str, min(rotations))))
    return app.scalability.get((nodes, gpus))


def rows_text(app, w, rows, at):
    entries = []
    xs = [r[0] for r in rows]
    for m in app.locals:
        step = interp(xs, [r[1] for r in rows], m)
        sync = interp(xs, [r[2] for r in rows], m)
        if step is not None:
            entries.append(f"{w}x{m:g}{at}={step:.6g}/{min(sync, step * 0.999):.6g}")
    return entries


def step_table(app):
    entries = []
    for w in WORKERS:
        if w > app.max_gpus():
            break
        rows = app.packed_rows(w)
        if rows is not None:
            entries += rows_text(app, w, rows, "")
    # Spread placements: the same GPUs on more nodes than they fit on.
    for w in range(2, app.max_gpus() + 1):
        for nodes in range(-(-w // GPUS_PER_NODE) + 1, min(w, 16) + 1):
            rows = spread_rows(app, w, nodes)
            if rows is not None:
                entries += rows_text(app, w, rows, f"@{nodes}")
    return ";".join(entries)


def noise_schedule(app, batch):
    """Per measured batch, per epoch: `B@F=N` (stoke interpolates between batches). A job whose
    batch is fixed gets the schedule at its batch alone."""
    target = app.progress(app.epochs)
    entries = []
    for b in ([batch] if app.name in FIXED_BATCH else app.batches):
        for e in range(app.epochs):
            sqr, var = app.grad_stats(b, e)
            noise = 1e12 if sqr <= 0 else min(1e12, max(0.0, app.b0 * var / sqr))
            fraction = app.progress(e) / target
            if fraction < 1:
                entries.append(f"{b}@{fraction:.9g}={noise:.6g}")
    return ";".join(entries)


HEADER = ("submit_s,name,work,min_workers,max_workers,scaling,resize_s,priority,noise_scale,batch_per_worker,"
          "batch,batch_range,micro_max,step_table,noise_schedule,b0,workers,start_s")


def job_row(app, name, submit_s, gpus, batch, table):
    fixed = FIXED_BATCH.get(app.name)
    batch = fixed or batch
    low, high = (fixed, fixed) if fixed else (app.b0, app.batch_max)
    work = app.b0 * app.progress(app.epochs)
    top = app.max_gpus()
    asked = max(1, min(gpus, top))
    return (f"{submit_s},{name},{work:.6g},1,{top},,{RESTART_S},1,,,{batch},{low}-{high},{app.micro_max:g},"
            f"{table},{noise_schedule(app, batch)},{app.b0},{asked},{RESTART_S}")


def trace_time(app, gpus, batch):
    """Seconds to train `app` alone on `gpus` at global `batch`, from the traces: per epoch, the
    progress to make over the progress per second (gain over step time, accumulation included)."""
    local = batch / gpus
    accum = max(1, math.ceil(local / app.micro_max - 1e-9)) - 1
    micro = local / (accum + 1)
    step, sync = app.step(gpus, micro)
    seconds = step + accum * (step - sync)
    scale = batch / app.b0
    total = 0.0
    for e in range(app.epochs):
        sqr, var = app.grad_stats(batch, e)
        gain = (var + sqr) / (var / scale + sqr)
        total += (app.progress(e + 1) - app.progress(e)) * seconds / gain
    return total + RESTART_S


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sim_dir, out_dir = sys.argv[1], sys.argv[2]
    folder = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--workloads" else "workloads"
    os.makedirs(out_dir, exist_ok=True)
    apps = {name: App(os.path.join(sim_dir, "traces", name), name) for name in EPOCHS}
    tables = {name: step_table(app) for name, app in apps.items()}
    workloads_dir = os.path.join(sim_dir, folder)
    for entry in sorted(os.listdir(workloads_dir)):
        if not entry.endswith(".csv"):
            continue
        rows = [HEADER]
        for r in read_rows(os.path.join(workloads_dir, entry)):
            app = apps[r["application"]]
            rows.append(job_row(app, r["name"], r["time"], int(r["num_replicas"]), int(r["batch_size"]),
                                tables[app.name]))
        with open(os.path.join(out_dir, entry), "w") as f:
            f.write("\n".join(rows) + "\n")
    # One job per application alone, at a batch and GPU count it runs in the workloads.
    single = [HEADER]
    expected = {}
    for name, app in apps.items():
        batch = FIXED_BATCH.get(name) or app.batches[min(2, len(app.batches) - 1)]
        gpus = max(1, min(app.max_gpus(), 4, int(batch // app.locals[0])))
        row = job_row(app, f"{name}-alone", 0, gpus, batch, tables[name])
        # Pinned to the asked GPUs: max_workers = workers = gpus.
        fields = row.split(",")
        fields[4] = str(gpus)
        fields[3] = str(gpus)
        single.append(",".join(fields))
        expected[f"{name}-alone"] = {"gpus": gpus, "batch": batch, "trace_s": trace_time(app, gpus, batch)}
    with open(os.path.join(out_dir, "single.csv"), "w") as f:
        f.write("\n".join(single) + "\n")
    with open(os.path.join(out_dir, "single.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"wrote {len(rows) - 1} jobs per workload and single.csv into {out_dir}")


if __name__ == "__main__":
    main()
