"""PyTorch peer of `stoke train --set train.recompute=P`: the same GPT as train_gpt.py with
`torch.utils.checkpoint` around the same parts stoke recomputes ("mlp": each block's LayerNorm +
MLP half, "attention": its LayerNorm + attention half, "block": whole blocks), the attention
variant stoke runs (bf16 batched matmuls with an additive causal mask under bf16 on a CPU up to
context 256, else SDPA), bf16 autocast, fused AdamW and clipping. Activation memory is measured the
way stoke measures it: glibc's bytes in use (mallinfo2) at the end of the forward pass minus before
it. Prints one JSON line.

    python recompute_gpt.py --data corpus.txt --preset tiny --recompute mlp --steps 30
"""
import argparse
import ctypes
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import train_gpt
from train_gpt import PRESETS, step_figures

PRESETS = dict(PRESETS)
PRESETS.setdefault("gpt2-124m", dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use():
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class Block(train_gpt.Block):
    """train_gpt's block (the same layers), split into the two halves checkpointing wraps."""

    def __init__(self, d, n_head, seq_len, math_attention):
        super().__init__(d, n_head)
        self.math_attention = math_attention
        if math_attention:
            self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1).to(torch.bfloat16),
                                 persistent=False)

    def attention(self, x):
        b, t, d = x.shape
        h = self.n_head
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        if self.math_attention:
            heads = lambda z: z.view(b, t, h, d // h).transpose(1, 2).reshape(b * h, t, d // h)
            q, k, v = heads(q), heads(k), heads(v)
            scores = torch.baddbmm(self.mask[:t, :t].expand(b * h, t, t), q, k.transpose(1, 2),
                                   beta=1.0, alpha=1.0 / math.sqrt(d // h))
            y = torch.bmm(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v).view(b, h, t, d // h)
        else:
            heads = lambda z: z.view(b, t, h, d // h).transpose(1, 2)
            y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))

    def mlp(self, x):
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, d_model, seq_len, vocab_size, recompute, math_attention):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList([Block(d_model, n_head, seq_len, math_attention) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.recompute = recompute
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        ckpt = lambda f, x: checkpoint(f, x, use_reentrant=False)
        for block in self.h:
            if self.recompute == "block":
                x = ckpt(lambda z, block=block: block.mlp(block.attention(z)), x)
            else:
                x = ckpt(block.attention, x) if self.recompute == "attention" else block.attention(x)
                x = ckpt(block.mlp, x) if self.recompute == "mlp" else block.mlp(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--recompute", choices=["none", "mlp", "attention", "block"], default="none")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--host-memory", choices=["retain", "system"], default="retain",
                    help="retain: glibc keeps freed memory (stoke's train.host_memory default)")
    args = ap.parse_args()
    if args.host_memory == "retain":
        train_gpt.retain_host_memory()
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    bf16 = args.precision == "bf16"
    model = GPT(**cfg, recompute=args.recompute, math_attention=bf16 and cfg["seq_len"] <= 256)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    t = cfg["seq_len"]
    data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64))
    rng = np.random.default_rng(args.seed)
    step_ms, activation_bytes, peak_in_use = [], None, None
    for step in range(args.steps):
        start = time.perf_counter()
        offsets = rng.integers(0, len(data) - t - 1, size=args.micro_batch)
        rows = torch.stack([data[o: o + t + 1] for o in offsets])
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        before = bytes_in_use()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        if step == 0:
            peak_in_use = bytes_in_use()
            activation_bytes = peak_in_use - before
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_ms.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({
        "peer": "pytorch-checkpoint",
        "recompute": args.recompute,
        "preset": args.preset,
        "torch": torch.__version__,
        **step_figures(step_ms[args.skip:], args.micro_batch * t),
        "activation_bytes": activation_bytes,
        "step_peak_bytes_in_use": peak_in_use,
        "final_loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
