"""PyTorch peer of `stoke train`: the same GPT (nanoGPT shape, SDPA attention, tied head), the same
data file, batch, precision and optimizer (AdamW with decoupled decay on matrices and embeddings,
global-norm clipping, warmup + cosine). Prints one JSON line with its step times and losses.

    python train_gpt.py --data corpus.txt --steps 60 --precision bf16
"""
import argparse
import json
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, d_model=256, seq_len=128, vocab_size=256),
    "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256, vocab_size=256),
}


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        heads = lambda z: z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, d_model, seq_len, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class TextWindows(torch.utils.data.Dataset):
    """The naive pipeline: a map-style dataset that decodes and tokenizes each sample on access."""

    def __init__(self, path, seq_len, n_samples, seed):
        with open(path, "rb") as f:
            self.text = f.read().decode("latin-1")
        self.seq_len = seq_len
        self.offsets = np.random.default_rng(seed).integers(0, len(self.text) - seq_len - 1, size=n_samples)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        o = int(self.offsets[i])
        ids = [ord(c) for c in self.text[o : o + self.seq_len + 1]]  # byte-level "tokenizer"
        return torch.tensor(ids, dtype=torch.long)


class MemmapWindows(torch.utils.data.Dataset):
    """The tuned pipeline: windows of a memory-mapped token file."""

    def __init__(self, path, seq_len, n_samples, seed):
        self.path, self.seq_len = path, seq_len
        self.data = None
        n = np.memmap(path, dtype=np.uint8, mode="r").shape[0]
        self.offsets = np.random.default_rng(seed).integers(0, n - seq_len - 1, size=n_samples)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        if self.data is None:  # opened in each worker
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        o = int(self.offsets[i])
        return torch.from_numpy(self.data[o : o + self.seq_len + 1].astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--pipeline", choices=["plain", "naive", "tuned"], default="plain",
                    help="plain: in-memory random windows (the same work as `stoke train`); naive: per-sample "
                         "tokenizing Dataset, default DataLoader, synchronous torch.save, .item() every step; "
                         "tuned: memmap Dataset, 2 workers with pin_memory and persistent workers, fused AdamW, "
                         "checkpoints written by a background thread")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--skip", type=int, default=1,
                    help="warm-up steps left out of the step figures (stoke's prof.skip_steps, default 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    model = GPT(**cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.99), eps=1e-8,
        # The tuned peer takes PyTorch's fused kernel (CPU support since 2.4); the others its default.
        fused=True if args.pipeline == "tuned" else None,
    )
    t = cfg["seq_len"]
    n_samples = args.steps * args.micro_batch
    if args.pipeline == "plain":
        data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64))
        rng = np.random.default_rng(args.seed)

        def batches():
            for _ in range(args.steps):
                offsets = rng.integers(0, len(data) - t - 1, size=args.micro_batch)
                yield torch.stack([data[o : o + t + 1] for o in offsets])
        batch_iter = batches()
    elif args.pipeline == "naive":
        batch_iter = iter(torch.utils.data.DataLoader(
            TextWindows(args.data, t, n_samples, args.seed), batch_size=args.micro_batch))
    else:
        batch_iter = iter(torch.utils.data.DataLoader(
            MemmapWindows(args.data, t, n_samples, args.seed), batch_size=args.micro_batch, num_workers=2,
            pin_memory=True, persistent_workers=True, prefetch_factor=4))

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)

    writer = None
    if args.pipeline == "tuned":
        import concurrent.futures
        writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pending = None

    def save(step):
        nonlocal pending
        path = f"{args.ckpt_dir}/step-{step}.pt"
        if writer is None:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, path)
            return
        if pending is not None:
            pending.result()
        # Copy on the critical path, write off it.
        state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                 "optim": copy_optim_state(opt.state_dict()), "step": step}
        pending = writer.submit(torch.save, state, path)

    step_ms, losses = [], []
    start_all = time.perf_counter()
    for step in range(args.steps):
        start = time.perf_counter()
        rows = next(batch_iter)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses.append(loss.item())
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save(step + 1)
        step_ms.append((time.perf_counter() - start) * 1e3)
    if pending is not None:
        pending.result()
    wall = time.perf_counter() - start_all
    tokens_per_step = args.micro_batch * t
    print(json.dumps({
        "peer": f"pytorch-{args.pipeline}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        **step_figures(step_ms[args.skip:], tokens_per_step),
        "tokens_per_s_wall": args.steps * tokens_per_step / wall,
        "first_loss": losses[0],
        # Mean of the last 10 logged losses, as `stoke bench` takes stoke's.
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "peak_rss_bytes": peak_rss_bytes(),
    }))


def step_figures(step_ms, tokens_per_step):
    """The step report's figures, defined as crates/prof's `stats` defines them: the median step
    time (the mean of the two middle ones for an even count), mean, 90th percentile by nearest
    rank, and tokens/s = tokens per step / median step time (`stats::tokens_per_s`)."""
    ordered = sorted(step_ms)
    median = statistics.median(ordered)
    p90 = ordered[max(1, math.ceil(0.9 * len(ordered))) - 1]
    mean = sum(ordered) / len(ordered)
    return {
        "steps_measured": len(ordered),
        "step_ms": median,
        "step_ms_mean": mean,
        "step_ms_p90": p90,
        "tokens_per_s": tokens_per_step / (median / 1e3),
        "tokens_per_s_mean": tokens_per_step * len(ordered) / (sum(ordered) / 1e3),
        "tokens_per_s_p90_step": tokens_per_step / (p90 / 1e3),
    }


def copy_optim_state(state):
    return {"state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                      for k, s in state["state"].items()},
            "param_groups": state["param_groups"]}


def peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
