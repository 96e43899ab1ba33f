"""PyTorch pipeline-parallel peer of `stoke launch --nproc N -- train --set dist.pipeline=N`: train_gpt.py's
GPT (nanoGPT's shape: learned positions, pre-norm blocks of LayerNorm with bias, SDPA causal attention,
exact-GELU MLP, final LayerNorm, a head tied to the token embedding, vocabulary of bytes) cut into
consecutive stages with PyTorch's own `torch.distributed.pipelining` (gloo, CPU, fp32), one stage a rank:

    stage 0        wte + wpe, the first blocks
    stage N - 1    the last blocks, ln_f and the head

The blocks are cut evenly, the first stages taking the smaller share when they do not divide (as stoke's
`dist.pipeline_split` "1 + n_layer / 2, n_layer - n_layer / 2 + 1" for 2 stages, which the bench passes
it). Each rank builds the whole model from the same seed and keeps its stage's modules (a
`PipelineStage` built by hand: no tracing), and a schedule runs the step's `--micro-batches` micro-batches
of `--micro-batch` rows through them:

    --schedule 1f1b          Schedule1F1B (PipeDream-Flush, Megatron-LM's default)
    --schedule gpipe         ScheduleGPipe (every forward, then every backward)
    --schedule interleaved   ScheduleInterleaved1F1B, 2 virtual stages a rank: the blocks cut into
                             2N chunks, rank r holds chunks r and r + N (Megatron-LM's interleaving)

The tied head. Across ranks the head cannot share the embedding's Parameter: the last stage holds its own
copy, made equal to wte at init. After backward the two copies' gradients are summed over the two ranks
that hold them (one all-reduce, Megatron-LM's embedding group), so both hold the gradient the tied matrix
gets in one process, and both run the same AdamW update on the same values: the copies stay equal (checked
with `--losses`, which reports the largest difference at the end). stoke sends the last stage's gradient to
the first, updates there and sends the values back; the arithmetic is the same.

The rest as a strong engineer runs it: the mean cross-entropy of each micro-batch, the schedule's gradients
scaled by 1 / micro-batches (scale_grads: the step's mean, as stoke's grad_accum), AdamW (betas 0.9/0.95,
eps 1e-8, decay 0.1 on the 2-D weights only, lr warmup then cosine as stoke's `TrainConfig::lr_at`) with
`fused=True` (the fused CPU kernel; `--adamw foreach` the other), global-norm clipping at 1.0 (each rank's
sum of squared gradients, the tied matrix counted once, one all-reduce), `torch.set_num_threads(--threads)`
per rank, glibc keeping freed memory (`--host-memory retain`, stoke's `train.host_memory` default). Every
rank draws the same rows (the first stage needs the tokens, the last the targets; stoke's stages read the
same micro-batches): random windows of a byte-level file (`--data`, e.g. `stoke corpus`'s) or, without
one, random tokens. The last stage's mean loss is all-reduced to every rank each step (stoke's logged loss
is summed over the ranks the same way). A step is timed from the batch's assembly to reading that loss
after `zero_grad`, as stoke's step is; the first `--warmup-steps` steps are left out (the schedule's
runtime shape inference runs in the first); the figures are train_gpt.step_figures' (stoke's definitions).
Rank 0 prints one JSON line.

    torchrun --nproc_per_node 2 pp_gpt.py --data corpus.txt --n-layer 4 --d-model 256 --n-head 8 \
        --seq-len 256 --micro-batch 8 --micro-batches 4 --schedule 1f1b --steps 30 --threads 1

World size 1 runs the whole model with the same init, data and optimizer, the micro-batches one after
another with their gradients accumulated (the head truly tied): the reference the pipelined runs' losses
are checked against with `--losses`. Checked (torch 2.11.0, CPU): `--steps 6 --losses`, n_layer 4,
d_model 256, n_head 8, seq_len 256, 4 micro-batches of 4 rows, vocab 256, the same seed and data
(`stoke corpus`): the per-step losses of 2 ranks under 1f1b, gpipe and interleaved agree with world size
1's to within 5e-7 (losses 5.57 -> 4.22), the gradient norms before clipping to within 3e-7 relative, and
the two copies of the tied matrix are bit-equal at the end; `--compile` gives the same losses within 5e-7.

`--compile` wraps each stage's module in torch.compile (Inductor) before its PipelineStage is built: one
graph a stage and micro-batch shape, its backward through AOTAutograd, which the schedule's
`stage_backward` drives as it drives an eager module's.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, retain_host_memory, step_figures  # noqa: E402


class Stage(nn.Module):
    """One chunk of the GPT: the embedding (the first chunk), consecutive blocks, ln_f and the head (the
    last chunk; its weight a copy of wte's)."""

    def __init__(self, model, blocks, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleList(model.h[i] for i in blocks)
        if last:
            self.ln_f = model.ln_f
            d_model, vocab = model.wte.weight.shape[1], model.wte.weight.shape[0]
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def chunk_bounds(n_layer, chunks):
    """Block ranges of `chunks` consecutive chunks, the earlier ones taking the smaller share."""
    if n_layer < chunks:
        sys.exit(f"pp_gpt.py: {n_layer} layers cannot fill {chunks} pipeline chunks")
    return [i * n_layer // chunks for i in range(chunks + 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (stoke's train.grad_accum)")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved"], default="1f1b")
    ap.add_argument("--steps", type=int, default=30, help="all steps, warm-up included")
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the step figures")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--data", default="", help="byte-level file to draw windows from; '' random tokens")
    ap.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default="fused")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--lr-warmup", type=int, default=50, help="stoke's train.warmup_steps")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--host-memory", choices=["retain", "system"], default="retain",
                    help="retain: glibc keeps freed memory (stoke's train.host_memory default)")
    ap.add_argument("--autogroup-nice", type=int, default=None,
                    help="write this nice to /proc/self/autogroup: torchrun starts each worker in a session of its "
                         "own, so out of the launching script's scheduling group and its nice (a bench gives the "
                         "workers its own group's)")
    ap.add_argument("--losses", action="store_true",
                    help="also print every step's grad norm and the tied copies' largest difference at the end")
    ap.add_argument("--compile", action="store_true", help="torch.compile each stage's module (Inductor)")
    args = ap.parse_args()
    if args.warmup_steps >= args.steps:
        sys.exit(f"pp_gpt.py: --warmup-steps {args.warmup_steps} leaves no step of --steps {args.steps} to measure")
    if args.autogroup_nice is not None:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(args.autogroup_nice))
    if args.host_memory == "retain":
        retain_host_memory()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # the same whole model on every rank before it is cut
    model = GPT(args.n_layer, args.n_head, args.d_model, args.seq_len, args.vocab)
    m = args.micro_batches
    pp = world > 1
    if pp:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        chunks = world * (2 if args.schedule == "interleaved" else 1)
        bounds = chunk_bounds(args.n_layer, chunks)
        mine = [c for c in range(chunks) if c % world == rank]  # rank r: chunks r, r + world, ...
        wrap = torch.compile if args.compile else (lambda module: module)
        stages = [PipelineStage(wrap(Stage(model, range(bounds[c], bounds[c + 1]), c == 0, c == chunks - 1)),
                                c, chunks, torch.device("cpu")) for c in mine]
        if args.schedule == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=cross_entropy)
        else:
            kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
            schedule = kind(stages[0], n_microbatches=m, loss_fn=cross_entropy)
        modules = [s.submod for s in stages]
        holds_first, holds_last = 0 in mine, chunks - 1 in mine
        last_rank = (chunks - 1) % world
        # The tied matrix's two copies: wte on rank 0, the head on the last chunk's rank.
        tie_group = None if world == 2 else dist.new_group([0, last_rank])
        tied = ([modules[0].wte.weight] if holds_first else []) + ([modules[-1].head.weight] if holds_last else [])
        layout = [f"rank {c % world}: chunk {c} (blocks {bounds[c]}-{bounds[c + 1] - 1}"
                  f"{', wte+wpe' if c == 0 else ''}{', ln_f+head' if c == chunks - 1 else ''})" for c in range(chunks)]
        del model
    else:
        model = torch.compile(model) if args.compile else model
        modules, tied, layout = [model], [], ["rank 0: the whole model"]
        holds_first = holds_last = True
        last_rank = 0

    params = [p for module in modules for p in module.parameters()]
    # The tied matrix counted once in the norm: the head's copy left out (rank 0 counts wte's).
    head_copy = modules[-1].head.weight if pp and holds_last else None
    counted = [p for p in params if p is not head_copy]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    kind = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[args.adamw]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **kind)

    def lr_at(step):  # stoke's TrainConfig::lr_at, horizon = the run's steps
        if step < args.lr_warmup:
            return args.lr * (step + 1) / args.lr_warmup
        progress = min(1.0, (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup))
        return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)

    t, rows_per_step = args.seq_len, args.micro_batch * m
    data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64)) if args.data else None
    rng = np.random.default_rng(args.seed)  # the same rows on every rank
    step_ms, losses, norms = [], [], []
    for step in range(args.steps):
        start = time.perf_counter()
        if data is not None:
            offsets = rng.integers(0, len(data) - t - 1, size=rows_per_step)
            rows = torch.stack([data[o: o + t + 1] for o in offsets])
        else:
            rows = torch.from_numpy(rng.integers(0, args.vocab, size=(rows_per_step, t + 1)))
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if pp:
            micro_losses = []
            if holds_first:
                schedule.step(x, target=y if holds_last else None, losses=micro_losses if holds_last else None)
            else:
                schedule.step(target=y if holds_last else None, losses=micro_losses if holds_last else None)
            loss = torch.stack(micro_losses).mean().detach() if holds_last else torch.zeros(())
            for p in tied:  # the tied matrix's gradient: the sum of its two copies'
                dist.all_reduce(p.grad, group=tie_group)
        else:
            loss = torch.zeros(())
            for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
                micro = model(xm, ym)
                (micro / m).backward()
                loss += micro.detach() / m
        # Global-norm clipping: each rank's sum of squares, one all-reduce.
        sq = torch.stack(torch._foreach_norm([p.grad for p in counted])).square().sum()
        if pp:
            dist.all_reduce(sq)
        total = sq.sqrt()
        torch._foreach_mul_([p.grad for p in params], torch.clamp(1.0 / (total + 1e-6), max=1.0))
        norms.append(total.item())
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pp:
            dist.all_reduce(loss)  # the last stage's; zero elsewhere
        losses.append(loss.item())
        step_ms.append((time.perf_counter() - start) * 1e3)

    tie_diff = None
    if args.losses and pp and world > 1:
        # The two copies of the tied matrix, compared on rank 0.
        if rank == last_rank:
            dist.send(modules[-1].head.weight.detach().contiguous(), 0)
        elif rank == 0:
            other = torch.empty_like(modules[0].wte.weight)
            dist.recv(other, last_rank)
            tie_diff = (other - modules[0].wte.weight.detach()).abs().max().item()
    figures = step_figures(step_ms[args.warmup_steps:], rows_per_step * t)
    if rank == 0:
        out = {
            "peer": f"pytorch-pp-{args.schedule}" if pp else "pytorch-1proc",
            "torch": torch.__version__,
            "backend": "gloo",
            "world_size": world,
            "threads": torch.get_num_threads(),
            "schedule": args.schedule if pp else "none",
            "micro_batches": m,
            "micro_batch": args.micro_batch,
            "layout": layout,
            "adamw": args.adamw,
            "compiled": args.compile,
            "host_memory": args.host_memory,
            "steps": args.steps,
            "tokens_per_step": rows_per_step * t,
            **figures,
            "step_ms_each": step_ms,
            "losses": losses,
            "final_loss": losses[-1],
        }
        if args.losses:
            out["grad_norms"] = norms
            if tie_diff is not None:
                out["tied_copies_max_diff"] = tie_diff
        print(json.dumps(out), flush=True)
    # Both ranks reach the teardown together: a rank tearing gloo down while its peer still sends
    # aborted one run in three here ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
