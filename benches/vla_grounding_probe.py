"""Can the vla model's architecture read a scene at all? A probe in PyTorch on `benches/peers/vla_torch.py`'s
twin of stoke's `vla-tiny`, trained by plain regression (no flow: the chunk's tokens carry no noise, so
the only way to lower the error is to read the prefix) on scenes drawn fresh every batch like the
built-in robot set's (64x64, a grey floor, coloured blocks, the effector as a white square), so nothing
can be remembered. It prints the held-out squared error every 250 steps beside the variance of the
targets (the error of a model that reads nothing).

    python benches/vla_grounding_probe.py --target block --objects 1 --readout backbone --steps 1500
    python benches/vla_grounding_probe.py --target block --objects 1 --readout tower-mean
    python benches/vla_grounding_probe.py --target block --objects 1 --readout pooled-into-chunk
    python benches/vla_grounding_probe.py --target actions --objects 3 --readout pooled-into-chunk --steps 3000
    python benches/vla_grounding_probe.py --target block --objects 3 --readout told --steps 1000
    TOLD_ORACLE=30 python benches/vla_grounding_probe.py --target block --objects 3 --readout told --steps 1000
    TOLD_SUM_SCALE=30 WORD_TOKENS=1 python benches/vla_grounding_probe.py --target block --objects 3 --readout told

--target block: the position of the block the instruction names (normalized); actions: the built-in
set's action chunk (moves toward that block, at most 0.08 a step and axis). --objects: blocks per
scene (with one, the instruction tells nothing). --readout: backbone (stoke's model: the chunk's
tokens read the prefix through the backbone's attention), tower-mean (a linear layer on the mean of
the vision tower's output, no backbone), pooled-into-chunk (stoke's model with the mean of the
projected vision tokens added to every chunk token before the backbone), told (pooled-into-chunk,
and before each vision block the tokens scaled and shifted, v·(1 + scale) + shift, by a FiLM layer
of the instruction's summary: the sum of its bytes' rows of a table of its own, init N(0, 1),
normalised without weight or bias; with TOLD_SUM_SCALE=K instead K times the sum of the model's own
embedding rows (`text.wte`, N(0, 0.02)) of those tokens; with TOLD_ORACLE=K instead K times the
model's own embedding of the colour word's first token, which names the colour alone: an oracle
that knows where to read). WORD_TOKENS=1: instructions as one token a word instead of a byte a token.
ABSOLUTE=1: the chunk is the commanded positions (where the effector is sent)
instead of the moves; ACTION_GAIN=G: the move is G times the distance to the block instead of
clipped at 0.08 (a proportional controller); STATE_INTO_CHUNK=1: the state's embedding is added to
every chunk token (stoke's model does). keypoints (told, without the tower's mean:
32 maps, each a softmax over the projected patches, their expected patch coordinates through a linear
layer added to every chunk token, stoke's model's readout); NO_FILM=1 leaves its FiLM layers out.
STOP_AT_ARRIVAL=1: an episode ends with the move that reaches the block, as the built-in set's do
(else it runs its 16 steps, standing still once there). FLOW=1: trained by flow matching as stoke's
model is (the noised chunk and its time in, the velocity out; held out, the chunk 10 Euler steps
integrate to from fixed noise), the time uniform or with BETA_TIME=1 as stoke draws it (0.999 (1 - u),
u ~ Beta(1.5, 1)). THREADS=N: libtorch's intra-op threads.

    THREADS=1 FLOW=1 BETA_TIME=1 STOP_AT_ARRIVAL=1 STATE_INTO_CHUNK=1 TOLD_SUM_SCALE=30 \
        python benches/vla_grounding_probe.py --target actions --objects 3 --readout keypoints --steps 1500
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from vla_torch import Shape, Vla, lr_at  # noqa: E402

PALETTE = np.array([[220, 40, 40], [40, 180, 60], [50, 80, 220], [230, 210, 40], [150, 60, 190], [240, 140, 30]],
                   np.uint8)
WORDS = ["red", "green", "blue", "yellow", "purple", "orange"]
SIDE, CHUNK, MAX_STEP, STEPS_PER_EPISODE = 64, 8, 0.08, 16
WORD_TOKENS = os.environ.get("WORD_TOKENS") == "1"
ABSOLUTE = os.environ.get("ABSOLUTE") == "1"
ACTION_GAIN = float(os.environ.get("ACTION_GAIN", "0"))
NO_FILM = os.environ.get("NO_FILM") == "1"
FLOW = os.environ.get("FLOW") == "1"
STOP_AT_ARRIVAL = os.environ.get("STOP_AT_ARRIVAL") == "1"
BETA_TIME = os.environ.get("BETA_TIME") == "1"
KEYPOINTS = 32


def square(frame, center, half, colour):
    h = max(1, round(half * SIDE))
    cx, cy = round(center[0] * SIDE), round(center[1] * SIDE)
    frame[max(0, cy - h):min(SIDE, cy + h), max(0, cx - h):min(SIDE, cx + h)] = colour


def sample(rng, n_objects):
    """One step of a fresh episode: frame, instruction bytes, state, target, action chunk and mask."""
    colours = rng.choice(len(PALETTE), n_objects, replace=False)
    blocks = []
    while len(blocks) < n_objects:
        p = rng.uniform(0.15, 0.85, 2)
        if all(np.abs(p - q).max() > 0.2 for q in blocks):
            blocks.append(p)
    named = rng.integers(n_objects)
    effector = rng.uniform(0.05, 0.95, 2)
    states, actions = [], []
    for _ in range(STEPS_PER_EPISODE):
        move = np.clip(blocks[named] - effector, -MAX_STEP, MAX_STEP)
        if ACTION_GAIN:
            move = ACTION_GAIN * (blocks[named] - effector)
        states.append(effector.copy())
        actions.append(move)
        effector = effector + move
        if STOP_AT_ARRIVAL and np.abs(blocks[named] - effector).max() < 1e-9:
            break
    t = rng.integers(len(states))
    frame = np.full((SIDE, SIDE, 3), 90, np.uint8)
    for colour, block in zip(colours, blocks):
        square(frame, block, 0.08, PALETTE[colour])
    square(frame, states[t], 0.035, [255, 255, 255])
    text = f"move to the {WORDS[colours[named]]} block".encode()
    if WORD_TOKENS:  # one token a word: move, to, the, the colour, block
        text = [1, 2, 3, 4 + colours[named], 4 + len(WORDS)]
    tokens = np.zeros(32, np.int64)
    tokens[:len(text)] = list(text)
    chunk, mask = np.zeros((CHUNK, 2)), np.zeros(CHUNK)
    for k in range(CHUNK):
        if t + k < len(states):
            chunk[k], mask[k] = actions[t + k], 1.0
            if ABSOLUTE:
                chunk[k] = (states[t + k] + actions[t + k] - 0.5) / 0.2 * 0.06
    return frame, tokens, states[t], blocks[named], chunk, mask


def batch(rng, n, args):
    rows = [sample(rng, args.objects) for _ in range(n)]
    stack = lambda i: np.stack([r[i] for r in rows])
    frames = torch.tensor(stack(0))[:, None]
    tokens = torch.tensor(stack(1))
    state = torch.tensor((stack(2) - 0.5) / 0.26, dtype=torch.float32)
    if args.target == "block":
        target = torch.tensor((stack(3) - 0.5) / 0.2, dtype=torch.float32)[:, None, :].repeat(1, CHUNK, 1)
        mask = torch.ones(n, CHUNK)
    else:
        target = torch.tensor(stack(4) / 0.06, dtype=torch.float32)
        mask = torch.tensor(stack(5), dtype=torch.float32)
    return frames, tokens, state, target, mask


def summary(model, tokens):
    """The instruction's summary for the told readout, `[rows, d]` (see the module's doc)."""
    oracle = float(os.environ.get("TOLD_ORACLE", "0"))
    if oracle:
        return model.text.wte(tokens[:, 3 if WORD_TOKENS else len(b"move to the ")]) * oracle
    present = (tokens != 0).float().unsqueeze(-1)
    scale = float(os.environ.get("TOLD_SUM_SCALE", "0"))
    if scale:
        return (model.text.wte(tokens) * present).sum(1) * scale
    rows = model.told_wte(tokens) * present
    return torch.nn.functional.layer_norm(rows.sum(1), (model.shape.d_model,))


def predict(model, head, frames, tokens, state, readout, flow=None):
    s = model.shape
    rows = frames.shape[0]
    v = model.patches(frames).view(rows * s.frames, s.patches_per_frame, s.d_model)
    told = summary(model, tokens).repeat_interleave(s.frames, 0).unsqueeze(1) if readout in ("told", "keypoints") else None
    for block_idx, block in enumerate(model.vision.blocks):
        if told is not None and not NO_FILM:
            scale, shift = model.films[block_idx](told).chunk(2, -1)
            v = v * (1.0 + scale) + shift
        v = block(v, model.vision_attend, None)
    if readout == "tower-mean":
        return head(v.mean(1)).unsqueeze(1).expand(-1, CHUNK, -1)
    else:
        v = model.projector(v.view(rows, s.vision_tokens, s.d_model))
        text = model.text.wte(tokens) + model.text.wpe(model.text_positions)
        chunk_in, time = flow if flow is not None else (torch.zeros(rows, CHUNK, 2), torch.zeros(rows))
        chunk = model.action_in(chunk_in) + model.time_embedding(time) + model.action_pos
        if readout in ("pooled-into-chunk", "told"):
            chunk = chunk + v.mean(1, keepdim=True)
        if readout == "keypoints":
            weights = model.kp_logits(v).softmax(1)  # [rows, patches, maps]
            chunk = chunk + model.kp_proj(torch.einsum("rpk,pc->rkc", weights, model.kp_grid).flatten(1)).unsqueeze(1)
        if os.environ.get("STATE_INTO_CHUNK") == "1":
            chunk = chunk + model.state_proj(state).unsqueeze(1)
        x = torch.cat([v, text, model.state_proj(state).unsqueeze(1), chunk], 1)
        for block in model.backbone.blocks:
            x = block(x, model.backbone_attend, model.backbone_mask)
        predicted = model.action_out(model.ln_f(x[:, -CHUNK:]))
    return predicted


def error(model, head, frames, tokens, state, target, mask, readout, evaluate=False):
    """Plain regression's squared error; under FLOW=1 flow matching's (the velocity target - noise
    from the noised chunk at a uniform time) and, evaluating, the squared error of the chunk 10
    Euler steps integrate to from noise (what stoke's eval_loss reports)."""
    if FLOW and readout not in ("tower-mean",):
        fixed = torch.Generator().manual_seed(12345) if evaluate else None  # the same noise every evaluation
        noise = torch.randn(target.shape, generator=fixed)
        if evaluate:
            actions = noise
            for step in range(10):
                time = torch.full((target.shape[0],), step / 10)
                actions = actions + predict(model, head, frames, tokens, state, readout, (actions, time)) / 10
            predicted = actions
        else:
            time = torch.rand(target.shape[0])
            if BETA_TIME:  # pi0's: 0.999 (1 - u), u ~ Beta(1.5, 1), more of the noisy end
                time = 0.999 * (1 - time.pow(2 / 3))
            noised = (1 - time.view(-1, 1, 1)) * noise + time.view(-1, 1, 1) * target
            predicted = predict(model, head, frames, tokens, state, readout, (noised, time))
            target = target - noise
    else:
        predicted = predict(model, head, frames, tokens, state, readout)
    return ((predicted - target).square() * mask.unsqueeze(-1)).sum() / target.numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=["block", "actions"], default="block")
    ap.add_argument("--objects", type=int, choices=[1, 2, 3], default=1)
    ap.add_argument("--readout", choices=["backbone", "tower-mean", "pooled-into-chunk", "told", "keypoints"], default="backbone")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    rng = np.random.default_rng(args.seed + 1)
    model = Vla(Shape("vla-tiny", 1, 2, 2), "matmul", "matmul", torch.float32)
    head = nn.Linear(model.shape.d_model, 2)
    d = model.shape.d_model
    model.told_wte = nn.Embedding(256, d)  # N(0, 1), PyTorch's default
    model.films = nn.ModuleList(nn.Linear(d, 2 * d) for _ in model.vision.blocks)  # PyTorch's default init
    model.kp_logits = nn.Linear(d, KEYPOINTS)  # PyTorch's default init
    model.kp_proj = nn.Linear(2 * KEYPOINTS, d)
    grid = model.shape.image_side // model.shape.patch
    rows, cols = torch.meshgrid(torch.linspace(-1, 1, grid), torch.linspace(-1, 1, grid), indexing="ij")
    model.register_buffer("kp_grid", torch.stack([cols, rows], -1).reshape(-1, 2))
    params = list(model.parameters()) + list(head.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    held_out = batch(rng, 512, args)
    variance = (held_out[3].square() * held_out[4].unsqueeze(-1)).sum().item() / held_out[3].numel()
    print(f"target {args.target}, {args.objects} object(s), readout {args.readout}: "
          f"held-out error of reading nothing {variance:.4f}", flush=True)
    start = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr=args.lr, min_lr=args.lr / 10)
        loss = error(model, head, *batch(rng, args.micro_batch, args), args.readout)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 250 == 0:
            with torch.no_grad():
                held = error(model, head, *held_out, args.readout, evaluate=True).item()
            print(f"step {step + 1}: held-out error {held:.4f} ({held / variance:.3f} of reading nothing), "
                  f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
