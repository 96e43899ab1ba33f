"""PyTorch DDP peer of `stoke launch --nproc N -- train`: train_gpt.py's GPT, each of N processes on its
own rows of the global batch (gloo, `torch.distributed`), one thread each, gradients averaged by
DistributedDataParallel in buckets that overlap backward, fused AdamW and global-norm clipping.

The attention is the one that is fastest on this machine for the precision: under bf16 the batched
matmuls with an additive causal mask (recompute_gpt.py's attention, what stoke's "auto" runs on a CPU
up to context 256), under fp32 scaled_dot_product_attention. `--compile` wraps the DDP model in
torch.compile (its DDP optimizer splits the graph at bucket boundaries); the compile time (the first
steps' time beyond a compiled step) is reported apart from the step figures.

Without RANK in the environment the script starts its own N workers (torchrun's variables on a free
loopback port) and prints rank 0's JSON line:

    python ddp_gpt.py --data corpus.txt --nproc 2 --steps 40 [--compile]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import recompute_gpt
import train_gpt
from train_gpt import PRESETS, step_figures


def build_model(cfg, attention):
    """train_gpt's GPT; with attention "math", its blocks are recompute_gpt's (train_gpt's layers
    with the matmul attention)."""
    if attention == "sdpa":
        return train_gpt.GPT(**cfg)

    class MathBlock(recompute_gpt.Block):
        def __init__(self, d, n_head):
            super().__init__(d, n_head, cfg["seq_len"], True)

        def forward(self, x):
            return self.mlp(self.attention(x))

    saved = train_gpt.Block
    train_gpt.Block = MathBlock  # GPT.__init__ builds its blocks from this name
    try:
        return train_gpt.GPT(**cfg)
    finally:
        train_gpt.Block = saved


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    """Starts args.nproc workers of this script with torchrun's variables; returns rank 0's line."""
    port = str(free_port())
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env, stdout=out))
    line = procs[0].communicate()[0].decode()
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"{os.path.basename(sys.argv[0])}: worker exit codes {codes}")
    sys.stdout.write(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--micro-batch", type=int, default=16, help="rows per process")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--attention", choices=["auto", "math", "sdpa"], default="auto")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the step figures")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--host-memory", choices=["retain", "system"], default="retain",
                    help="retain: glibc keeps freed memory (stoke's train.host_memory default)")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return launch(args)
    if args.host_memory == "retain":
        train_gpt.retain_host_memory()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP also broadcasts it)
    cfg = PRESETS[args.preset]
    bf16 = args.precision == "bf16"
    attention = args.attention
    if attention == "auto":
        attention = "math" if bf16 and cfg["seq_len"] <= 256 else "sdpa"
    model = build_model(cfg, attention)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    step_fn = torch.compile(ddp) if args.compile else ddp
    t = cfg["seq_len"]
    data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64))
    rng = np.random.default_rng(args.seed + rank)  # each rank its own rows
    step_ms, losses = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        offsets = rng.integers(0, len(data) - t - 1, size=args.micro_batch)
        rows = torch.stack([data[o: o + t + 1] for o in offsets])
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_ms.append((time.perf_counter() - start) * 1e3)
    figures = step_figures(step_ms[args.skip:], world * args.micro_batch * t)
    # Compile (and first-step) time: the warm-up steps' time beyond as many median steps.
    warmup_s = (sum(step_ms[:args.skip]) - args.skip * figures["step_ms"]) / 1e3
    if rank == 0:
        print(json.dumps({
            "peer": "pytorch-ddp" + ("-compile" if args.compile else ""),
            "torch": torch.__version__,
            "backend": "gloo",
            "world_size": world,
            "threads": torch.get_num_threads(),
            "attention": attention,
            "precision": args.precision,
            "bucket_mb": args.bucket_mb,
            "steps": args.steps,
            **figures,
            "compile_s" if args.compile else "warmup_s": warmup_s,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
