"""PyTorch peer of `stoke train`: the same GPT (nanoGPT shape, tied head), the same data file, batch,
precision and optimizer (AdamW with decoupled decay on matrices and embeddings, global-norm clipping,
warmup + cosine). Prints one JSON line with its step times, per-phase times and losses.

    python train_gpt.py --data corpus.txt --steps 60 --precision bf16                 # plain
    python train_gpt.py --data corpus.txt --steps 60 --precision bf16 --attention matmul \
        --adamw fused --host-memory retain --compile                                    # tuned

The two peers `benches/train_vs_pytorch.sh` compares against:
- plain: eager, `F.scaled_dot_product_attention` (under bf16 autocast it runs in bf16), PyTorch's
  default AdamW (on a CPU a per-tensor loop), the C allocator's defaults.
- tuned: the attention variant that is fastest for the preset and precision on the machine (the
  script measures it), `torch.compile` (or eager, both are reported), fused AdamW, glibc keeping
  freed memory (`--host-memory retain`, what stoke's `train.host_memory = "retain"` sets), no
  DataLoader workers (the batch is a few KiB of tokens; workers only take cores from the step).

Timing. A step is timed from the batch's assembly to the end of `zero_grad`, phase by phase with the
same boundaries as stoke's step report (data_wait, forward, backward, optimizer: clipping, the
update and reading the loss; checkpoints in ckpt_stall); on a CPU every op has finished when it
returns, so the phase times are exact. The first `--skip` steps are left out of the figures on both
sides (compilation happens in the first step under `--compile`; it is reported as `first_steps_s`
and `compile_s`). `tokens_per_s` = tokens per step / median steady step time, as crates/prof's
`stats::tokens_per_s` defines stoke's.
"""
import argparse
import ctypes
import json
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# The same shapes as stoke's `model.preset` (crates/train/src/config.rs).
PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, d_model=256, seq_len=128, vocab_size=256),
    "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256, vocab_size=256),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304),
}

PHASES = ("data_wait", "forward", "backward", "optimizer", "ckpt_stall")
# Queries per block of the matmul-blocked attention: stoke's train.causal_block_rows default.
CAUSAL_BLOCK_ROWS = 128


class Block(nn.Module):
    def __init__(self, d, n_head, seq_len=0, attention="sdpa"):
        super().__init__()
        self.n_head = n_head
        self.attention_kind = attention
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        if attention in ("matmul", "matmul-blocked"):
            # Additive causal mask; autocast casts it with the scores' operands.
            self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        if self.attention_kind == "matmul":
            # Explicit batched matrix multiplies in the compute type (what stoke's bf16-math runs):
            # scores = mask + q k^T / sqrt(hd), softmax (16-bit out), times v.
            heads = lambda z: z.view(b, t, self.n_head, hd).transpose(1, 2).reshape(b * self.n_head, t, hd)
            q, k, v = heads(q), heads(k), heads(v)
            scores = torch.baddbmm(self.mask[:t, :t].expand(b * self.n_head, t, t), q, k.transpose(1, 2),
                                   beta=1.0, alpha=1.0 / math.sqrt(hd))
            y = torch.bmm(torch.softmax(scores, dim=-1), v).view(b, self.n_head, t, hd)
        elif self.attention_kind == "matmul-blocked":
            # The same in blocks of CAUSAL_BLOCK_ROWS queries, each against only the keys at or
            # before its last row (what stoke's train.causal_block_rows does): the upper triangle
            # of the square is never computed.
            heads = lambda z: z.view(b, t, self.n_head, hd).transpose(1, 2).reshape(b * self.n_head, t, hd)
            q, k, v = heads(q), heads(k), heads(v)
            blocks = []
            for start in range(0, t, CAUSAL_BLOCK_ROWS):
                end = min(start + CAUSAL_BLOCK_ROWS, t)
                scores = torch.baddbmm(self.mask[start:end, :end].expand(b * self.n_head, end - start, end),
                                       q[:, start:end], k[:, :end].transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(hd))
                blocks.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :end]))
            y = torch.cat(blocks, dim=1).view(b, self.n_head, t, hd)
        else:
            heads = lambda z: z.view(b, t, self.n_head, hd).transpose(1, 2)
            q, k, v = heads(q), heads(k), heads(v)
            if self.attention_kind == "sdpa-fp32":
                # fp32 SDPA on q, k, v cast up (stoke's choice under bf16 at long context).
                with torch.autocast("cpu", enabled=False):
                    y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, d_model, seq_len, vocab_size, attention="sdpa"):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        # Other peers (ddp_gpt.py) put their own block class under this module's `Block` name and
        # build it with (d, n_head).
        extra = () if attention == "sdpa" else (seq_len, attention)
        self.h = nn.ModuleList([Block(d_model, n_head, *extra) for _ in range(n_layer)])
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
    """The fullchain's tuned pipeline: windows of a memory-mapped token file."""

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


# glibc's mallopt parameters (malloc.h) and the values stoke's `train.host_memory = "retain"` sets
# (crates/train/src/host_memory.rs): every block from the heap (no mmap, whatever its size), freed
# blocks kept there, never trimmed, the heap grown 64 MiB at a time.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
RETAIN = ((M_MMAP_MAX, 0), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))


def retain_host_memory():
    libc = ctypes.CDLL("libc.so.6")
    for param, value in RETAIN:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise SystemExit(f"train_gpt.py: glibc refused mallopt({param}, {value})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--attention", choices=["sdpa", "sdpa-fp32", "matmul", "matmul-blocked"], default="sdpa",
                    help="sdpa: F.scaled_dot_product_attention in the autocast type (bf16 under bf16); sdpa-fp32: "
                         "the same on q, k, v cast to fp32; matmul: batched matrix multiplies in the compute type "
                         "with an additive causal mask (stoke's bf16-math with train.causal_block_rows = 0); "
                         "matmul-blocked: the same, 128 queries at a time against only the keys at or before "
                         "them (stoke's bf16-math)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    ap.add_argument("--adamw", choices=["default", "foreach", "fused"], default=None,
                    help="PyTorch's AdamW implementation (default: fused for --pipeline tuned, else PyTorch's "
                         "default, which is a per-tensor loop on a CPU)")
    ap.add_argument("--host-memory", choices=["system", "retain"], default="system",
                    help="retain: glibc keeps freed memory (stoke's train.host_memory = \"retain\")")
    ap.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    ap.add_argument("--pipeline", choices=["plain", "naive", "tuned"], default="plain",
                    help="plain: in-memory random windows on the training thread (the same work as `stoke train`'s "
                         "loader); naive: per-sample tokenizing Dataset, default DataLoader, synchronous torch.save, "
                         ".item() every step; tuned: memmap Dataset, --workers DataLoader workers (persistent), "
                         "--pin-memory, checkpoints written by a background thread")
    ap.add_argument("--workers", type=int, default=2,
                    help="tuned: DataLoader worker processes (0: batches made on the training thread); "
                         "`stoke bench fullchain` picks the fastest by measurement")
    ap.add_argument("--pin-memory", choices=["on", "off"], default="on", help="tuned: the DataLoader's pin_memory")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--skip", type=int, default=1,
                    help="warm-up steps left out of the step figures (stoke's prof.skip_steps; give both sides the "
                         "same)")
    ap.add_argument("--profile", default="",
                    help="write torch.profiler's op table of the steady steps to this file (and a Chrome trace "
                         "next to it, .json)")
    args = ap.parse_args()
    if args.skip >= args.steps:
        raise SystemExit(f"train_gpt.py: --skip {args.skip} leaves no step of --steps {args.steps} to measure")
    if args.host_memory == "retain":
        retain_host_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    adamw = args.adamw or ("fused" if args.pipeline == "tuned" else "default")
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    model = GPT(**cfg, attention=args.attention)
    if args.attention in ("matmul", "matmul-blocked") and args.precision == "bf16":
        # The mask in the compute type, as stoke keeps it: no cast of it per layer and step.
        for block in model.h:
            block.mask = block.mask.to(torch.bfloat16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.99), eps=1e-8,
        fused=True if adamw == "fused" else None,
        foreach=True if adamw == "foreach" else None,
    )
    forward = torch.compile(model) if args.compile else model
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
        workers = {"num_workers": args.workers}
        if args.workers > 0:
            workers.update(persistent_workers=True, prefetch_factor=4)
        batch_iter = iter(torch.utils.data.DataLoader(
            MemmapWindows(args.data, t, n_samples, args.seed), batch_size=args.micro_batch,
            pin_memory=args.pin_memory == "on", **workers))

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

    profiler = None
    step_ms, phase_ms, losses = [], [], []
    start_all = time.perf_counter()
    for step in range(args.steps):
        if args.profile and step == args.skip:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            profiler.__enter__()
        phases = dict.fromkeys(PHASES, 0.0)
        start = last = time.perf_counter()

        def lap(phase):
            nonlocal last
            now = time.perf_counter()
            phases[phase] += (now - last) * 1e3
            last = now

        rows = next(batch_iter)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        lap("data_wait")
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = forward(x, y)
        lap("forward")
        loss.backward()
        lap("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses.append(loss.item())
        lap("optimizer")
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save(step + 1)
            lap("ckpt_stall")
        step_ms.append((time.perf_counter() - start) * 1e3)
        phase_ms.append(phases)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        with open(args.profile, "w") as f:
            f.write(profiler.key_averages(group_by_input_shape=False).table(sort_by="self_cpu_time_total", row_limit=60))
            f.write("\n")
        profiler.export_chrome_trace(args.profile.rsplit(".", 1)[0] + ".json")
    if pending is not None:
        pending.result()
    wall = time.perf_counter() - start_all
    tokens_per_step = args.micro_batch * t
    steady = step_ms[args.skip:]
    first_steps_s = sum(step_ms[: args.skip]) / 1e3
    print(json.dumps({
        "peer": f"pytorch-{args.pipeline}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "precision": args.precision,
        "micro_batch": args.micro_batch,
        "attention": args.attention,
        "compiled": args.compile,
        "workers": args.workers if args.pipeline == "tuned" else None,
        "pin_memory": args.pin_memory == "on" if args.pipeline == "tuned" else None,
        "adamw": adamw,
        "host_memory": args.host_memory,
        "deterministic": args.deterministic,
        "steps": args.steps,
        "skip": args.skip,
        "tokens_per_step": tokens_per_step,
        **step_figures(steady, tokens_per_step),
        # Median of each phase over the steady steps, ms (stoke's report.json `phases_ms` are means).
        "phases_ms_median": {p: statistics.median(s[p] for s in phase_ms[args.skip:]) for p in PHASES},
        "phases_ms_mean": {p: statistics.fmean(s[p] for s in phase_ms[args.skip:]) for p in PHASES},
        # The skipped steps' time, and what they took beyond as many steady steps: under --compile
        # that is (almost all) compilation.
        "first_steps_s": first_steps_s,
        "compile_s": first_steps_s - args.skip * statistics.median(steady) / 1e3,
        "wall_s": wall,
        "tokens_per_s_wall": args.steps * tokens_per_step / wall,
        "first_loss": losses[0],
        # Mean of the last 10 logged losses, as `stoke bench` takes stoke's.
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "peak_rss_bytes": peak_rss_bytes(),
    }))


def step_figures(step_ms, tokens_per_step):
    """The step report's figures, defined as crates/prof's `stats` defines them: the median step
    time (the mean of the two middle ones for an even count), mean, 90th percentile by nearest
    rank, the fastest step, and tokens/s = tokens per step / median step time (`stats::tokens_per_s`)."""
    ordered = sorted(step_ms)
    median = statistics.median(ordered)
    p90 = ordered[max(1, math.ceil(0.9 * len(ordered))) - 1]
    mean = sum(ordered) / len(ordered)
    return {
        "steps_measured": len(ordered),
        "step_ms": median,
        "step_ms_mean": mean,
        "step_ms_p90": p90,
        "step_ms_min": ordered[0],
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
