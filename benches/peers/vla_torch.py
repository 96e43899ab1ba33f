"""PyTorch peer of `stoke train --set model.family=vla`: the same vision-language-action model
(crates/train/src/models/vla/mod.rs), written as a strong PyTorch engineer writes it for a CPU, and
its training step timed. Prints the parameter count first (it equals stoke's `model.n_params`), then
the attention it picked, then one JSON line of figures (also written to `--json OUT`).

    python vla_torch.py --preset vla-small --micro-batch 8 --precision bf16 --steps 20 --json out.json
    python vla_torch.py --preset vla-tiny --steps 5 --no-compile --attention sdpa     # a smoke run

The model, parameter for parameter (names as stoke's, shapes as stoke's):
- the embedding: frames (uint8, `[batch, frames, side, side, 3]`) normalised to x/127.5 - 1, cut
  into patches and projected by one matrix multiply (`vision.patch_embed`), plus `vision.pos_embed`;
  the instruction's tokens (`text.wte`) plus their positions (`text.wpe`), zero where padding; the state
  (`state_proj`); the action chunk: `action_in` of the noised chunk (1 - t)·noise + t·actions, plus
  the time MLP (`time_mlp.0`, SiLU, `time_mlp.2`) of sinusoidal features of 1000·t (sines, then
  cosines, frequencies exp(-ln(10000)·i/half)), plus `action_pos`, plus the state's embedding;
- `vision.blocks.*`: GPT-2 blocks (pre-LayerNorm, fused qkv with bias, exact-GELU MLP of 4d) over
  the vision tokens, attending both ways within each frame's patches, each block's input first
  scaled and shifted, v·(1 + scale) + shift, by its FiLM layer (`vision.blocks.N.film`, a linear
  layer, weight U(-1/sqrt(d), 1/sqrt(d))) of 30 times the sum of the instruction's positions;
- `projector` (a linear layer) on the tower's output, and its keypoints added to the chunk's
  tokens: 32 maps (`keypoints.logits`, weight U(-1/sqrt(d), 1/sqrt(d)), zero bias), each a softmax
  over a frame's patches, their expected patch coordinates (column, row in [-1, 1]) through
  `keypoints.proj` (weight U(-1/sqrt(fan_in), 1/sqrt(fan_in)), zero bias); stoke does both at the
  start of the first backbone block, which is the same function;
- `backbone.blocks.*`: the same blocks over the whole sequence [patches, instruction, state,
  chunk] under the prefix mask: the prefix attends to the prefix only, the chunk to everything;
- `ln_f` and `action_out` on the chunk's positions; the loss is flow matching's: the mean squared
  error between the prediction and the velocity actions - noise, over the actions that exist.
Init as stoke's: N(0, 0.02), the residual projections (`attn.c_proj`, `mlp.c_proj`) 0.02/sqrt(2 x
blocks) over all blocks, zero biases, unit LayerNorms. Optimizer as stoke's defaults: AdamW (lr
2e-3 with 50 warmup steps then cosine to 2e-4, betas 0.9/0.99, eps 1e-8, decay 0.1 on tensors of
two or more dimensions), global-norm clipping at 1.0, the loss read every step.

What makes it the strong peer, all chosen here and reported:
- `torch.compile` of the model's forward and backward (inductor; `--no-compile` for eager);
- attention: under `--attention auto`, the fastest of SDPA and plain matmul-softmax attention at the
  run's exact shapes, dtype and compile mode, for the vision tower (SDPA without mask) and for the
  backbone (SDPA with the boolean prefix mask) apart, by interleaved timing of forward + backward in
  this same invocation, before the model is built;
- AdamW with `fused=True` (PyTorch 2.11 takes it on a CPU);
- bf16: `torch.autocast("cpu", dtype=torch.bfloat16)`: fp32 master weights, matrix multiplies and
  attention in bf16, LayerNorm and the residual stream in fp32 (what stoke's bf16 does);
- bf16's products: under `--products auto`, native or widened (fp32 products of bf16-rounded
  operands, rounded back to bf16: what stoke does on a CPU without native bf16 products), whichever
  runs a linear layer at the run's rows faster, timed in this same invocation;
- the intra-op threads stoke uses (libtorch's default, one per physical core; `--threads N` sets
  them, as `train.threads = N` does stoke's);
- glibc keeping freed memory (`--host-memory retain`, default; what stoke's `train.host_memory`
  default sets).

Timing. The batches (random uint8 frames, random token ids (none of them padding), normal state,
actions and noise, flow times drawn as stoke draws them, every action present) have the shapes a
`stoke train` run of the preset feeds on its built-in robot set (1 frame, state and action width 2) and are made once before timing: the peer's
step excludes data loading, while stoke's step includes its data wait (under 1% of its step here).
A step is timed from setting its learning rate to reading its loss after `zero_grad`; the first
`--warmup` steps are left out (compilation happens in the first; `compile_s` is the first step's
time beyond a median step). `step_ms` is the median of the `--steps` timed steps, as stoke's
report.json `step_ms` is the median of its steps after `prof.skip_steps`.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from train_gpt import retain_host_memory, step_figures

# The vla presets (crates/train/src/config/model.rs): the backbone's blocks come on top of the
# vision blocks; the sequence is vision tokens + instruction tokens + 1 state token + the chunk.
PRESETS = {
    "vla-tiny": dict(vision_layers=2, backbone_layers=4, n_head=4, d_model=128, vocab_size=256,
                     patch=8, image_side=64, chunk=8, instruction_tokens=32),
    "vla-small": dict(vision_layers=4, backbone_layers=6, n_head=6, d_model=384, vocab_size=256,
                      patch=16, image_side=224, chunk=16, instruction_tokens=32),
}
LAYER_NORM_EPS = 1e-5
KEYPOINTS = 32  # stoke's VLA_KEYPOINTS: the spatial-softmax readout's maps
SUMMARY_SCALE = 30.0  # stoke's: what the FiLM layers read is 30x the instruction's summed positions
ATTENTION_KINDS = ("sdpa", "matmul")
PRODUCT_KINDS = ("native", "fp32")
# Whether bf16's matrix products run widened (--products): set once, before any model is built.
WIDEN = [False]


BF16 = torch.bfloat16


# The widened products are opaque ops (Inductor would otherwise fold the casts around an fp32
# product back into a bf16 one), each with its backward of widened products.
@torch.library.custom_op("vla_peer::wide_mm", mutates_args=())
def wide_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 (or bf16 values held in fp32) 2-D or 3-D (batched) a and b: fp32 product,
    rounded to bf16."""
    with torch.autocast("cpu", enabled=False):
        return torch.matmul(a.float(), b.float()).to(BF16)


@wide_mm.register_fake
def _(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=BF16)


def _wide_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _wide_mm_backward(ctx, grad):
    # The gradient, read by both products, widened once (a widened operand passes as it is).
    a, b = ctx.saved_tensors
    grad = grad.float()
    return wide_mm(grad, b.transpose(-2, -1)), wide_mm(a.transpose(-2, -1), grad)


wide_mm.register_autograd(_wide_mm_backward, setup_context=_wide_mm_setup)


class Linear(nn.Linear):
    """nn.Linear; with WIDEN (a bf16 run), its product runs in fp32 on its bf16 operands and the
    result is rounded to bf16: a native bf16 product's values (up to the order of its sums), by
    fp32's units (what stoke does on a CPU that does not multiply bf16)."""

    def forward(self, x):
        if not WIDEN[0]:
            return super().forward(x)
        y = wide_mm(x.to(BF16).reshape(-1, x.shape[-1]), self.weight.to(BF16).t())
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(BF16)


def bmm(a, b):
    """torch.bmm, widened as Linear is."""
    return wide_mm(a.to(BF16), b.to(BF16)) if WIDEN[0] else torch.bmm(a, b)


def baddbmm(bias, a, b, alpha):
    """torch.baddbmm, widened as Linear is (the bias added after the product's rounding)."""
    if not WIDEN[0]:
        return torch.baddbmm(bias, a, b, alpha=alpha)
    return bias + bmm(a, b) * alpha


class Shape:
    """The resolved shape, with stoke's `VlaShape` parameter count."""

    def __init__(self, preset, frames, state_dim, action_dim):
        for key, value in PRESETS[preset].items():
            setattr(self, key, value)
        self.frames, self.state_dim, self.action_dim = frames, state_dim, action_dim
        self.n_layer = self.vision_layers + self.backbone_layers
        self.patches_per_frame = (self.image_side // self.patch) ** 2
        self.vision_tokens = self.frames * self.patches_per_frame
        self.patch_dim = 3 * self.patch * self.patch
        self.seq_len = self.vision_tokens + self.instruction_tokens + 1 + self.chunk

    def n_params(self):
        """`VlaShape::n_params`, term by term."""
        d = self.d_model
        embedding = ((self.patch_dim + 1) * d + self.vision_tokens * d + self.vocab_size * d
                     + self.instruction_tokens * d + (self.state_dim + 1) * d + (self.action_dim + 1) * d
                     + 2 * (d * d + d) + self.chunk * d)
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        k = KEYPOINTS
        projector = (d * d + d) + (d * k + k) + (self.frames * 2 * k * d + d)
        film = 2 * d * d + 2 * d
        head = 2 * d + (d + 1) * self.action_dim
        return embedding + self.n_layer * block + self.vision_layers * film + projector + head


def attend_sdpa(q, k, v, mask):
    """`F.scaled_dot_product_attention`, with the boolean mask (True: may attend) or none."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend_matmul(q, k, v, bias):
    """Plain attention: scores = q kᵀ/sqrt(hd) (+ the additive mask, 0 or -inf, in the compute
    type), softmax, times v, as batched matrix multiplies."""
    rows, n_head, t, hd = q.shape
    q, k, v = (z.reshape(rows * n_head, t, hd) for z in (q, k, v))
    if bias is None:
        scores = bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(hd))
    else:
        scores = baddbmm(bias.expand(rows * n_head, t, t), q, k.transpose(1, 2), alpha=1.0 / math.sqrt(hd))
    return bmm(torch.softmax(scores, dim=-1), v).view(rows, n_head, t, hd)


ATTEND = {"sdpa": attend_sdpa, "matmul": attend_matmul}


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Linear(d, 3 * d)
        self.c_proj = Linear(d, d)

    def forward(self, x, attend, mask):
        rows, t, d = x.shape
        heads = lambda z: z.view(rows, t, self.n_head, d // self.n_head).transpose(1, 2)
        q, k, v = self.c_attn(x).split(d, dim=2)
        y = attend(heads(q), heads(k), heads(v), mask)
        return self.c_proj(y.transpose(1, 2).reshape(rows, t, d))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = Linear(d, 4 * d)
        self.c_proj = Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """GPT-2's block; LayerNorm reads the fp32 residual stream, so under autocast it runs in fp32."""

    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.attn = Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(d)

    def forward(self, x, attend, mask):
        x = x + self.attn(self.ln_1(x), attend, mask)
        return x + self.mlp(self.ln_2(x))


class Vision(nn.Module):
    def __init__(self, shape):
        super().__init__()
        d = shape.d_model
        self.patch_embed = Linear(shape.patch_dim, d)
        self.pos_embed = nn.Parameter(torch.empty(shape.vision_tokens, d))
        self.blocks = nn.ModuleList(Block(d, shape.n_head) for _ in range(shape.vision_layers))
        for block in self.blocks:
            block.film = Linear(d, 2 * d)  # vision.blocks.N.film: the instruction's FiLM layer


class Text(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.wpe = nn.Embedding(shape.instruction_tokens, shape.d_model)


class Backbone(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.n_head) for _ in range(shape.backbone_layers))


class Vla(nn.Module):
    def __init__(self, shape, vision_attention, backbone_attention, compute_dtype):
        super().__init__()
        self.shape = shape
        d = shape.d_model
        self.vision = Vision(shape)
        self.text = Text(shape)
        self.state_proj = Linear(shape.state_dim, d)
        self.action_in = Linear(shape.action_dim, d)
        self.time_mlp = nn.Sequential(Linear(d, d), nn.SiLU(), Linear(d, d))
        self.action_pos = nn.Parameter(torch.empty(shape.chunk, d))
        self.projector = Linear(d, d)
        self.keypoint_logits = Linear(d, KEYPOINTS)
        self.keypoint_proj = Linear(shape.frames * 2 * KEYPOINTS, d)
        self.backbone = Backbone(shape)
        self.ln_f = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.action_out = Linear(d, shape.action_dim)
        self.vision_attend = ATTEND[vision_attention]
        self.backbone_attend = ATTEND[backbone_attention]
        half = d // 2
        self.register_buffer("freqs", torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / half)),
                             persistent=False)
        self.register_buffer("text_positions", torch.arange(shape.instruction_tokens), persistent=False)
        # The backbone's mask in the form its attention takes: boolean (True: may attend) for
        # SDPA, additive (0 or -inf) in the compute type for the matmul attention.
        mask = prefix_mask(shape)
        if backbone_attention == "sdpa":
            self.register_buffer("backbone_mask", mask, persistent=False)
        else:
            self.register_buffer("backbone_mask", additive(mask, compute_dtype), persistent=False)
        proj_std = 0.02 / math.sqrt(2 * shape.n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight")
                nn.init.normal_(p, 0.0, proj_std if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)
        for block in self.vision.blocks:  # FiLM weights as stoke's: U(-1/sqrt(d), 1/sqrt(d))
            nn.init.uniform_(block.film.weight, -1.0 / math.sqrt(d), 1.0 / math.sqrt(d))
        nn.init.uniform_(self.keypoint_logits.weight, -1.0 / math.sqrt(d), 1.0 / math.sqrt(d))
        kp_in = shape.frames * 2 * KEYPOINTS
        nn.init.uniform_(self.keypoint_proj.weight, -1.0 / math.sqrt(kp_in), 1.0 / math.sqrt(kp_in))
        # The patches' positions start as MAE's 2-D sine-cosine table, as stoke's do.
        grid = shape.image_side // shape.patch
        scale = torch.linspace(-1.0, 1.0, grid) if grid > 1 else torch.zeros(1)
        rows, cols = torch.meshgrid(scale, scale, indexing="ij")
        self.register_buffer("keypoint_grid", torch.stack([cols, rows], -1).reshape(-1, 2), persistent=False)
        with torch.no_grad():
            self.vision.pos_embed.copy_(sincos_2d(grid, shape.d_model).repeat(shape.frames, 1))

    def patches(self, frames):
        """`[batch, vision_tokens, d]`: each frame's patches projected, plus their positions."""
        s = self.shape
        p, grid = s.patch, s.image_side // s.patch
        batch = frames.shape[0]
        x = frames.float() / 127.5 - 1.0
        x = x.view(batch, s.frames, grid, p, grid, p, 3).permute(0, 1, 2, 4, 3, 5, 6)
        x = x.reshape(batch, s.vision_tokens, s.patch_dim)
        return self.vision.patch_embed(x).float() + self.vision.pos_embed

    def time_embedding(self, t):
        angles = (t * 1000.0).unsqueeze(1) * self.freqs.unsqueeze(0)
        return self.time_mlp(torch.cat([angles.sin(), angles.cos()], dim=1)).float().unsqueeze(1)

    def forward(self, frames, tokens, token_mask, state, actions, action_mask, noise, t):
        s = self.shape
        batch, d = frames.shape[0], s.d_model
        # Padding's positions hold zeros (token_mask 0), as stoke's do.
        text = (self.text.wte(tokens) + self.text.wpe(self.text_positions)) * token_mask.unsqueeze(-1)
        # The vision tower, frame by frame, each block's input scaled and shifted by its FiLM
        # layer from 30 times the sum of the instruction's positions; then the projector.
        summary = (text.float().sum(1) * SUMMARY_SCALE).repeat_interleave(s.frames, 0)
        v = self.patches(frames).view(batch * s.frames, s.patches_per_frame, d)
        for block in self.vision.blocks:
            scale, shift = block.film(summary).float().unsqueeze(1).chunk(2, -1)
            v = block(v * (1.0 + scale) + shift, self.vision_attend, None)
        v = self.projector(v.view(batch, s.vision_tokens, d)).float()
        state_token = self.state_proj(state).float().unsqueeze(1)
        chunk_in = (1.0 - t.view(-1, 1, 1)) * noise + t.view(-1, 1, 1) * actions
        # The chunk's tokens carry the state and the projected tower's keypoints in their own stream.
        maps = self.keypoint_logits(v).float().view(batch, s.frames, s.patches_per_frame, KEYPOINTS).softmax(2)
        keypoints = self.keypoint_proj((maps.transpose(2, 3) @ self.keypoint_grid).reshape(batch, -1)).float()
        chunk = (self.action_in(chunk_in).float() + self.time_embedding(t) + self.action_pos + state_token
                 + keypoints.unsqueeze(1))
        x = torch.cat([v, text, state_token, chunk], dim=1)
        for block in self.backbone.blocks:
            x = block(x, self.backbone_attend, self.backbone_mask)
        predicted = self.action_out(self.ln_f(x[:, -s.chunk:])).float()
        mask = action_mask.unsqueeze(-1)
        count = mask.sum().clamp_min(1.0) * s.action_dim
        return ((predicted - (actions - noise)).square() * mask).sum() / count


def sincos_2d(grid, d):
    """MAE's 2-D sine-cosine table, [grid * grid, d]: per patch (row-major) its row then its
    column, each as sines then cosines at frequencies 1 / 10000^(i / (d / 4))."""
    quarter = d // 4
    freqs = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    patch = torch.arange(grid * grid)
    parts = []
    for position in (patch // grid, patch % grid):
        angles = position[:, None].double() * freqs[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


def prefix_mask(shape):
    """`[seq, seq]` bool, True where a backbone position may attend: the prefix within itself, the
    action chunk everywhere (stoke's `backbone_mask`)."""
    positions = torch.arange(shape.seq_len)
    prefix = shape.seq_len - shape.chunk
    return (positions < prefix).unsqueeze(0) | (positions >= prefix).unsqueeze(1)


def additive(mask, dtype):
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def make_batches(shape, micro_batch, n_batches, seed):
    """What stoke's episode loader hands its model, made up: `n_batches` of them, cycled."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    out = []
    for _ in range(n_batches):
        out.append((
            torch.randint(0, 256, (micro_batch, s.frames, s.image_side, s.image_side, 3), dtype=torch.uint8, generator=g),
            torch.randint(0, s.vocab_size, (micro_batch, s.instruction_tokens), generator=g),
            torch.ones(micro_batch, s.instruction_tokens),
            torch.randn(micro_batch, s.state_dim, generator=g),
            torch.randn(micro_batch, s.chunk, s.action_dim, generator=g),
            torch.ones(micro_batch, s.chunk),
            torch.randn(micro_batch, s.chunk, s.action_dim, generator=g),
            0.999 * (1.0 - torch.rand(micro_batch, generator=g).pow(2.0 / 3.0)),  # the flow time, as stoke draws it
        ))
    return out


def pick_attention(site, shape, micro_batch, args, compute_dtype):
    """The fastest attention for one site ("vision" or "backbone") at the run's shapes: forward and
    backward of each candidate, compiled if the model will be, timed in interleaved rounds (the
    order alternating), the lowest median kept. Returns (kind, {kind: median ms})."""
    hd = shape.d_model // shape.n_head
    if site == "vision":
        rows, t, bool_mask = micro_batch * shape.frames, shape.patches_per_frame, None
    else:
        rows, t, bool_mask = micro_batch, shape.seq_len, prefix_mask(shape)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, shape.n_head, t, hd, generator=g).to(compute_dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(rows, shape.n_head, t, hd, generator=g).to(compute_dtype)
    masks = {"sdpa": bool_mask, "matmul": None if bool_mask is None else additive(bool_mask, compute_dtype)}
    fns = {kind: torch.compile(ATTEND[kind], fullgraph=True) if args.compile else ATTEND[kind] for kind in ATTENTION_KINDS}

    def run(kind):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            y = fns[kind](q, k, v, masks[kind])
        y.backward(grad)
        for z in (q, k, v):
            z.grad = None

    return fastest(ATTENTION_KINDS, run, args.pick_rounds, warm_calls=2)  # compilation, then one warm call


def fastest(kinds, run, rounds, warm_calls):
    """`run(kind)` for each kind `warm_calls` times, then `rounds` interleaved rounds (the order
    alternating) timed; the kind of the lowest median, and {kind: median ms}."""
    times = {kind: [] for kind in kinds}
    for kind in kinds:
        for _ in range(warm_calls):
            run(kind)
    for round_idx in range(rounds):
        order = kinds if round_idx % 2 == 0 else kinds[::-1]
        for kind in order:
            start = time.perf_counter()
            run(kind)
            times[kind].append((time.perf_counter() - start) * 1e3)
    medians = {kind: statistics.median(ms) for kind, ms in times.items()}
    return min(medians, key=medians.get), medians


def pick_products(shape, micro_batch, args):
    """bf16's matrix products native or widened (`Linear`), whichever runs the MLP's first layer's
    forward and backward at the run's rows faster, timed in interleaved rounds (the order
    alternating), eager. Returns (kind, {kind: median ms})."""
    g = torch.Generator().manual_seed(0)
    rows, d = micro_batch * shape.seq_len, shape.d_model
    layer = Linear(d, 4 * d)
    x = torch.randn(rows, d, generator=g).requires_grad_()
    grad = torch.randn(rows, 4 * d, generator=g).to(torch.bfloat16)

    def run(kind):
        WIDEN[0] = kind == "fp32"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad)
        x.grad = layer.weight.grad = layer.bias.grad = None

    return fastest(PRODUCT_KINDS, run, args.pick_rounds, warm_calls=1)


def lr_at(step, total, lr=2e-3, min_lr=2e-4, warmup=50):
    """stoke's schedule with its defaults: linear warmup, cosine to min_lr at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="vla-small")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=2, help="steps run before timing (compilation in the first)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the model (default on)")
    ap.add_argument("--attention", choices=["auto", *ATTENTION_KINDS], default="auto",
                    help="auto: the fastest of sdpa and matmul per site, timed here; or one for both sites")
    ap.add_argument("--pick-rounds", type=int, default=6,
                    help="interleaved timing rounds of --attention auto and --products auto")
    ap.add_argument("--products", choices=["auto", *PRODUCT_KINDS], default="auto",
                    help="bf16's matrix products: native, or fp32 on bf16-rounded operands with the result "
                    "rounded to bf16; auto: the faster, timed here")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads; 0 keeps libtorch's default "
                    "(one per physical core, what stoke's train.threads = 0 keeps)")
    ap.add_argument("--host-memory", choices=["retain", "system"], default="retain",
                    help="retain: glibc keeps freed memory (stoke's train.host_memory default)")
    ap.add_argument("--frames", type=int, default=1, help="frames per sample (the built-in robot set: 1)")
    ap.add_argument("--state-dim", type=int, default=2)
    ap.add_argument("--action-dim", type=int, default=2)
    ap.add_argument("--batches", type=int, default=16, help="distinct batches made up front, cycled")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("vla_torch.py: --steps must be at least 1")
    if args.host_memory == "retain":
        retain_host_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape(args.preset, args.frames, args.state_dim, args.action_dim)
    compute_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    print(f"vla_torch: {args.preset}, n_params {shape.n_params()}, seq {shape.seq_len}, micro-batch "
          f"{args.micro_batch}, {args.precision}, {torch.get_num_threads()} threads, torch {torch.__version__}",
          flush=True)

    products, products_ms = "native", {}
    if args.precision == "bf16":
        if args.products == "auto":
            products, products_ms = pick_products(shape, args.micro_batch, args)
            fmt = lambda ms: ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
            print(f"vla_torch: bf16 products, a linear layer's forward + backward: {fmt(products_ms)} -> {products}",
                  flush=True)
        else:
            products = args.products
    WIDEN[0] = products == "fp32"

    pick_ms = {}
    if args.attention == "auto":
        vision_attention, pick_ms["vision"] = pick_attention("vision", shape, args.micro_batch, args, compute_dtype)
        backbone_attention, pick_ms["backbone"] = pick_attention("backbone", shape, args.micro_batch, args, compute_dtype)
        torch._dynamo.reset()
        fmt = lambda ms: ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
        print(f"vla_torch: attention forward + backward: vision {fmt(pick_ms['vision'])} -> {vision_attention}; "
              f"backbone {fmt(pick_ms['backbone'])} -> {backbone_attention}", flush=True)
    else:
        vision_attention = backbone_attention = args.attention

    torch.manual_seed(args.seed)
    model = Vla(shape, vision_attention, backbone_attention, compute_dtype)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == shape.n_params(), f"the peer has {n_params} parameters, stoke's formula {shape.n_params()}"
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    forward = torch.compile(model, fullgraph=True) if args.compile else model
    batches = make_batches(shape, args.micro_batch, min(args.batches, args.warmup + args.steps), args.seed)
    params = list(model.parameters())

    total = args.warmup + args.steps
    step_ms, losses = [], []
    for step in range(total):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = forward(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_ms.append((time.perf_counter() - start) * 1e3)

    steady = step_ms[args.warmup:]
    median = statistics.median(steady)
    figures = {
        "peer": "pytorch-vla",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "precision": args.precision,
        "micro_batch": args.micro_batch,
        "seq_len": shape.seq_len,
        "n_params": n_params,
        "compiled": args.compile,
        "attention": {"vision": vision_attention, "backbone": backbone_attention},
        "attention_pick_ms": pick_ms,
        "products": products,
        "products_pick_ms": products_ms,
        "adamw": "fused",
        "host_memory": args.host_memory,
        "steps": args.steps,
        "warmup": args.warmup,
        **step_figures(steady, args.micro_batch * shape.seq_len),
        "step_ms_all": step_ms,
        "first_step_s": step_ms[0] / 1e3,
        "compile_s": (step_ms[0] - median) / 1e3 if args.compile else 0.0,
        "first_loss": losses[0],
        "final_loss": losses[-1],
    }
    line = json.dumps(figures)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
