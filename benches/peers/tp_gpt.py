"""PyTorch tensor-parallel peer of `stoke launch --nproc N -- train --set dist.tensor=N --set
model.family="gpt-rms"`: the same gpt-rms model (nanoGPT's GPT with RMSNorm, eps 1e-6, scale only, in
fp32; no biases; learned positions; pre-norm blocks; SDPA causal attention; exact-GELU MLP; final norm and
a head tied to the token embedding; mean cross-entropy), cut over the N ranks of a DeviceMesh with
PyTorch's own `torch.distributed.tensor.parallel` (gloo, CPU, fp32):

    c_attn, c_fc       ColwiseParallel  (output rows: this rank's heads / MLP inner slice)
    both c_proj        RowwiseParallel  (input columns; the all-reduce after each branch)
    wte                RowwiseParallel  (vocabulary rows; the embedding's all-reduce)
    lm_head (tied)     ColwiseParallel  (vocabulary rows, logits left sharded) with loss_parallel():
                       the vocabulary-parallel cross-entropy, the logits never gathered
    wpe, the norms     replicated (plain tensors; their gradients come out whole on every rank, the
                       Partial gradient of each Colwise input being all-reduced by DTensor's backward)

c_attn's rows are laid out head-major (for each head its q, k and v rows): ColwiseParallel cuts the
matrix in contiguous row blocks, and with this layout each block holds whole heads' q, k and v, as
stoke's three-block split of nanoGPT's [q; k; v] rows does. It is a permutation of nanoGPT's rows, the
same model at a random init. `--head replicated` keeps wte and the head whole on every rank instead
(no loss_parallel), the other cut PyTorch's tutorial allows.

`--sequence-parallel` adds PyTorch's sequence parallelism as its TP tutorial lays it out (Korthikanti et
al., 2022; stoke's `dist.sequence_parallel`): between the branches the residual stream is this rank's piece
of the sequence, Shard(1), [batch, seq / N, d]. SequenceParallel() on ln_1, ln_2 and ln_f (their weights
Replicate DTensors, the norms and the residual additions on the pieces); c_attn and c_fc
ColwiseParallel(input_layouts=Shard(1)), which all-gathers the normed pieces (attention needs the whole
sequence; backward, a reduce-scatter); both c_proj RowwiseParallel(output_layouts=Shard(1)), a
reduce-scatter in place of the all-reduce; wte RowwiseParallel(output_layouts=Shard(1)), the embedding's
reduce-scatter, and the tied head ColwiseParallel(input_layouts=Shard(1)), ln_f's pieces gathered before the
vocabulary-parallel logits. wpe stays a plain tensor: its [t, d] output, whole on every rank, is cut to the
rows of this rank's positions by PrepareModuleOutput(Replicate -> Shard(0)), no collective forward, an
all-gather of that [t, d] gradient backward (so every rank gets wpe's whole gradient). With `--head
replicated` wte's output is cut the same way (PrepareModuleOutput Replicate -> Shard(1)) and the head's
input gathered (PrepareModuleInput Shard(1) -> Replicate). The norms' weights come out of backward with
Partial(sum) gradients (each piece's share), which DTensor leaves unreduced: `reduce_partial_grads` sums
them in one all-reduce into Replicate gradients before clipping, which counts them once. seq_len must
divide by N.

The rest as a strong engineer runs it: AdamW (betas 0.9/0.95, eps 1e-8, decay 0.1 on the 2-D weights
only, lr warmup then cosine as stoke's `TrainConfig::lr_at`) with `fused=True` over the DTensor and the
plain parameters alike (one call, under `implicit_replication()`, which treats the plain ones as
replicated), global-norm clipping at 1.0 with one all-reduce of the sharded parameters' squared norms
(the replicated ones counted once), `torch.set_num_threads(--threads)` per rank, glibc keeping freed
memory (`--host-memory retain`, train_gpt.py's and stoke's `train.host_memory` default). Every rank
draws the same batch (tensor parallelism: one copy of the model, one batch): random windows of a
byte-level file (`--data`, e.g. `stoke corpus`'s) or, without one, random tokens. A step is timed from
the batch's assembly to reading the loss after `zero_grad`, as stoke's step is; the first `--warmup-steps`
steps are left out; the figures are train_gpt.step_figures' (stoke's definitions). Rank 0 prints one
JSON line.

    torchrun --nproc_per_node 2 tp_gpt.py --data corpus.txt --n-layer 4 --d-model 256 --n-head 8 \
        --seq-len 256 --micro-batch 8 --steps 30 --threads 1

World size 1 runs the plain model (no DTensor, no parallel style) with the same init, data and
optimizer: the reference. Checked (torch 2.11.0, CPU, this file as committed): `--steps 6 --losses`
with --nproc_per_node 1 and 2, n_layer 4, d_model 256, n_head 8, seq_len 256, micro_batch 8, vocab 256,
the same seed and data (`stoke corpus`): the per-step losses of world size 2 agree with world size 1's
to within 5e-7 (max |diff| over the 6 steps, losses 5.62 -> 4.22) with `--head vocab` (loss_parallel)
and with `--head replicated`, the gradient norms before clipping to within 2e-6 relative. `--compile`
(each cut block under torch.compile) gives the eager run's losses within 1e-6 over 6 steps (2 layers,
d_model 64, 2 ranks).

`--sequence-parallel` checked the same way (2 layers, d_model 64, 4 heads, seq_len 32, micro_batch 4,
`stoke corpus` data, `--steps 6 --losses --threads 1`): world size 2's losses agree with world size 1's
within 1e-6, max |diff| 9.5e-7 with `--head vocab` and 4.8e-7 with `--head replicated` (losses 5.54 ->
5.43); with `--lr-warmup 1` 4.8e-7 with either head (5.54 -> 4.70); random tokens 9.5e-7; the gradient
norms within 4e-7 relative. With the norms' gradients left Partial (no `reduce_partial_grads`) the
gradient norm is 1.6e-3 relative off and the losses 4.3e-6. `--compile --sequence-parallel` gives the
eager run's losses within 5e-7.
"""
import argparse
import contextlib
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
from train_gpt import retain_host_memory, step_figures  # noqa: E402

RMS_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.size(-1),), self.weight, RMS_NORM_EPS)


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.head_dim = d // n_head
        self.c_attn = nn.Linear(d, 3 * d, bias=False)  # rows head-major: (head, q|k|v, head_dim)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # Under tensor parallelism c_attn's output is this rank's heads only (a local tensor).
        qkv = self.c_attn(x).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = RMSNorm(d)
        self.attn = Attention(d, n_head)
        self.ln_2 = RMSNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, d_model, n_head, seq_len, vocab):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d_model),
            wpe=nn.Embedding(seq_len, d_model),
            h=nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)]),
            ln_f=RMSNorm(d_model),
        ))
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():  # the tied matrix once (named_parameters dedups)
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, proj_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def parallelize(model, mesh, head, sequence_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    # Under sequence parallelism the residual stream is Shard(1) (this rank's piece of the sequence):
    # each branch's Colwise input all-gathers it, its Rowwise output reduce-scatters back into it.
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for i in range(len(model.transformer.h)):
        plan[f"transformer.h.{i}.attn.c_attn"] = ColwiseParallel(input_layouts=seq)
        plan[f"transformer.h.{i}.attn.c_proj"] = RowwiseParallel(output_layouts=seq)
        plan[f"transformer.h.{i}.mlp.c_fc"] = ColwiseParallel(input_layouts=seq)
        plan[f"transformer.h.{i}.mlp.c_proj"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"transformer.h.{i}.ln_1"] = SequenceParallel()
            plan[f"transformer.h.{i}.ln_2"] = SequenceParallel()
    if sequence_parallel:
        plan["transformer.ln_f"] = SequenceParallel()
        # The positions' embedding [t, d], whole on every rank (wpe stays a plain tensor), cut to this
        # rank's rows, the positions of its piece: no collective forward, an all-gather of the [t, d]
        # gradient backward, after which every rank holds wpe's whole gradient.
        plan["transformer.wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    if head == "vocab":
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    elif sequence_parallel:
        # wte and the head whole: the embedding's output cut to this rank's piece (its gradient
        # all-gathered), the final norm's pieces gathered for the head (its gradient cut).
        plan["transformer.wte"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["lm_head"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                              use_local_output=True)
    parallelize_module(model, mesh, plan)
    if head == "vocab":
        # Each style made its own DTensor from the tied matrix; both are Shard(0) of [vocab, d]: tie again.
        model.lm_head.weight = model.transformer.wte.weight
    return model


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_partial_grads(params, group):
    """SequenceParallel's norm weights are Replicate DTensors used on this rank's piece of the sequence: the
    backward leaves each a Partial(sum) gradient (the piece's share), which DTensor does not reduce. All of
    them summed in one all-reduce, made Replicate (whole and equal on every rank) for clipping and AdamW."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    partial = [p for p in params
               if isinstance(p.grad, DTensor) and any(isinstance(q, Partial) for q in p.grad.placements)]
    if not partial:
        return
    flat = torch.cat([p.grad.to_local().reshape(-1) for p in partial])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in partial:
        shard = p.grad.to_local()
        whole = flat[offset: offset + shard.numel()].view_as(shard)
        mesh = p.grad.device_mesh
        p.grad = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        offset += shard.numel()


def clip_grad_norm(params, max_norm, sharded_group):
    """Global-norm clipping over sharded (DTensor Shard) and replicated (plain or DTensor Replicate)
    parameters: the shards' squared norms all-reduced once, the replicated ones (whole on every rank)
    added once."""
    def sharded_grad(g):
        placements = getattr(g, "placements", ())
        assert not any(q.is_partial() for q in placements), "reduce_partial_grads first"
        return any(q.is_shard() for q in placements)
    sharded = [local(p.grad) for p in params if p.grad is not None and sharded_grad(p.grad)]
    plain = [local(p.grad) for p in params if p.grad is not None and not sharded_grad(p.grad)]
    zero = torch.zeros((), dtype=torch.float32)
    sq_sharded = torch.stack(torch._foreach_norm(sharded)).square().sum() if sharded else zero.clone()
    if sharded:
        dist.all_reduce(sq_sharded, group=sharded_group)
    sq_plain = torch.stack(torch._foreach_norm(plain)).square().sum() if plain else zero
    total = (sq_sharded + sq_plain).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(sharded + plain, coef)
    return total.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per step (every rank the same rows)")
    ap.add_argument("--steps", type=int, default=30, help="all steps, warm-up included")
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the step figures")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--data", default="", help="byte-level file to draw windows from; '' random tokens")
    ap.add_argument("--head", choices=["vocab", "replicated"], default="vocab",
                    help="vocab: wte Rowwise + tied head Colwise + loss_parallel; replicated: both whole")
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
    ap.add_argument("--losses", action="store_true", help="also print every step's loss and grad norm")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each block after it is cut (Inductor fuses the norms, GELU and residuals)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="the residual stream as each rank's piece of the sequence (SequenceParallel norms; "
                         "all-gather / reduce-scatter around the branches in place of the all-reduces)")
    args = ap.parse_args()
    if args.autogroup_nice is not None:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(args.autogroup_nice))
    if args.host_memory == "retain":
        retain_host_memory()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.n_head % world or args.vocab % world:
        sys.exit(f"tp_gpt.py: n_head {args.n_head} and vocab {args.vocab} must divide by the world size {world}")
    if args.sequence_parallel and args.seq_len % world:
        sys.exit(f"tp_gpt.py: --sequence-parallel cuts seq_len {args.seq_len} in equal pieces: it must divide by "
                 f"the world size {world}")

    torch.manual_seed(args.seed)  # the same whole model on every rank before it is cut
    model = GPT(args.n_layer, args.d_model, args.n_head, args.seq_len, args.vocab)
    tp = world > 1
    if tp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import implicit_replication
        from torch.distributed.tensor.parallel import loss_parallel
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize(model, mesh, args.head, args.sequence_parallel)
        group = mesh.get_group()
    else:
        implicit_replication = contextlib.nullcontext
        group = None
    vocab_parallel = tp and args.head == "vocab"
    sequence_parallel = tp and args.sequence_parallel
    if args.compile:
        # Each block on its own (the cut modules' DTensor collectives inside), as torchtitan compiles.
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = torch.compile(block)

    params = list(model.parameters())  # the tied matrix once
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

    t = args.seq_len
    data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64)) if args.data else None
    rng = np.random.default_rng(args.seed)  # the same rows on every rank
    step_ms, losses, norms = [], [], []
    for step in range(args.steps):
        start = time.perf_counter()
        if data is not None:
            offsets = rng.integers(0, len(data) - t - 1, size=args.micro_batch)
            rows = torch.stack([data[o: o + t + 1] for o in offsets])
        else:
            rows = torch.from_numpy(rng.integers(0, args.vocab, size=(args.micro_batch, t + 1)))
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with loss_parallel() if vocab_parallel else contextlib.nullcontext():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
            loss.backward()
        if sequence_parallel:
            reduce_partial_grads(params, group)
        norms.append(clip_grad_norm(params, 1.0, group))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with implicit_replication():
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(local(loss).item())
        step_ms.append((time.perf_counter() - start) * 1e3)
    figures = step_figures(step_ms[args.warmup_steps:], args.micro_batch * t)
    if rank == 0:
        out = {
            "peer": "pytorch-tp" if tp else "pytorch-1proc",
            "torch": torch.__version__,
            "backend": "gloo",
            "world_size": world,
            "threads": torch.get_num_threads(),
            "styles": ("Colwise c_attn/c_fc, Rowwise c_proj" +
                       (", Rowwise wte + Colwise tied head + loss_parallel" if vocab_parallel else
                        ", wte/head replicated") +
                       (", SequenceParallel norms (sequence pieces between the branches)" if sequence_parallel else "")
                       ) if tp else "none",
            "adamw": args.adamw,
            "compiled": args.compile,
            "sequence_parallel": sequence_parallel,
            "host_memory": args.host_memory,
            "steps": args.steps,
            **figures,
            "final_loss": losses[-1],
        }
        if args.losses:
            out["losses"] = losses
            out["grad_norms"] = norms
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
