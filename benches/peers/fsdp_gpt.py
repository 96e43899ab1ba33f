"""PyTorch FSDP peer of `stoke launch --nproc N -- train --set dist.zero=S`: ddp_gpt.py's GPT (train_gpt's
model with the attention that is fastest here), each of N processes on its own rows of the global batch
(gloo on loopback, one thread each), under FullyShardedDataParallel with each transformer block its own
FSDP unit (auto-wrap on the block class; the embedding, final norm and tied head are the root unit).

    --sharding full_shard      parameters, gradients and optimizer state sharded; a block's parameters are
                               gathered for its forward, freed, and gathered again for its backward (ZeRO 3)
    --sharding shard_grad_op   gradients and optimizer state sharded; parameters stay gathered from the
                               forward to the backward (ZeRO 2)

The same tricks as the DDP peer: fused AdamW (decay on matrices, none on vectors, so
use_orig_params=True), global-norm clipping (FSDP's clip_grad_norm_, an all-reduce of the shards'
norms), bf16 autocast with fp32 parameters.

    --api fsdp2                FSDP2 instead (`fully_shard` per block and on the root, over a CPU device
                               mesh; full_shard reshards after the forward, shard_grad_op does not), with
                               MixedPrecisionPolicy under bf16: parameters gathered and computed in bf16,
                               gradients reduced in bf16, fp32 shards kept for the optimizer. Memory per rank: the peak resident set (VmHWM from
/proc/self/status, what getrusage's ru_maxrss reports and what stoke's report calls peak memory),
glibc's bytes in use (mallinfo2) at its highest after a step, and the model states FSDP holds, counted
from its tensors between two steps (local parameter shards, their gradients, the optimizer's state).
torch has no allocator counters on a CPU (torch.cuda.max_memory_allocated is CUDA's only).

Without RANK in the environment the script starts its own N workers (torchrun's variables on a free
loopback port) and prints rank 0's JSON line, which carries every rank's memory:

    python fsdp_gpt.py --data corpus.txt --nproc 2 --sharding full_shard --steps 40
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ddp_gpt import build_model, launch
from recompute_gpt import bytes_in_use as malloc_in_use
from train_gpt import PRESETS, step_figures

STRATEGIES = {"full_shard": ShardingStrategy.FULL_SHARD, "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP}


def status_bytes(field):
    """A `kB` field of /proc/self/status (VmHWM, VmRSS) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def tensor_bytes(tensors):
    """Bytes of distinct storages among `tensors` (views of one flat buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_state_bytes(fsdp, opt):
    """What FSDP keeps between two steps: each unit's flat parameter (its local shard after the
    step), the flat gradients, and the optimizer's state tensors (not its scalar step counters)."""
    flat = [h.flat_param for h in FSDP.fsdp_modules(fsdp) for h in [h._handle] if h is not None]
    optimizer = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "parameters": tensor_bytes(flat),
        "gradients": tensor_bytes([p.grad for p in flat]),
        "optimizer": tensor_bytes(optimizer),
    }


def fsdp2(model, args, world, bf16):
    """FSDP2: each block, then the root, `fully_shard`ed over a CPU mesh; bf16 MixedPrecisionPolicy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    reshard = args.sharding == "full_shard"
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model, len(model.h) + 1


def fsdp2_state_bytes(model, opt):
    """FSDP2's local shards (DTensor parameters), their gradients and the optimizer's state."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    optimizer = [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"parameters": tensor_bytes(params), "gradients": tensor_bytes(grads), "optimizer": tensor_bytes(optimizer)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n-layer", type=int, help="override the preset's blocks")
    ap.add_argument("--d-model", type=int, help="override the preset's width")
    ap.add_argument("--n-head", type=int, help="override the preset's heads")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sharding", choices=sorted(STRATEGIES), default="full_shard")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--micro-batch", type=int, default=16, help="rows per process")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--attention", choices=["auto", "math", "sdpa"], default="auto")
    ap.add_argument("--forward-prefetch", action="store_true", help="FSDP's forward_prefetch")
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the step figures")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--api", choices=["fsdp1", "fsdp2"], default="fsdp1")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return launch(args)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model on every rank (FSDP also broadcasts it)
    cfg = dict(PRESETS[args.preset])
    for key, value in (("n_layer", args.n_layer), ("d_model", args.d_model), ("n_head", args.n_head)):
        if value is not None:
            cfg[key] = value
    bf16 = args.precision == "bf16"
    attention = args.attention
    if attention == "auto":
        attention = "math" if bf16 and cfg["seq_len"] <= 256 else "sdpa"
    model = build_model(cfg, attention)
    n_params = sum(p.numel() for p in model.parameters())
    block_class = type(model.h[0])
    if args.api == "fsdp2":
        fsdp, n_units = fsdp2(model, args, world, bf16)
    else:
        fsdp = FSDP(model, sharding_strategy=STRATEGIES[args.sharding], auto_wrap_policy=ModuleWrapPolicy({block_class}),
                    device_id=torch.device("cpu"), use_orig_params=True, forward_prefetch=args.forward_prefetch,
                    sync_module_states=False)
        n_units = len(FSDP.fsdp_modules(fsdp))
    decay = [p for n, p in fsdp.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in fsdp.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.99), eps=1e-8, fused=True)
    t = cfg["seq_len"]
    data = torch.from_numpy(np.fromfile(args.data, dtype=np.uint8).astype(np.int64))
    rng = np.random.default_rng(args.seed + rank)  # each rank its own rows
    step_ms, losses, in_use_peak = [], [], 0
    for step in range(args.steps):
        start = time.perf_counter()
        offsets = rng.integers(0, len(data) - t - 1, size=args.micro_batch)
        rows = torch.stack([data[o: o + t + 1] for o in offsets])
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and args.api == "fsdp1"):
            loss = fsdp(x, y)
        loss.backward()
        if args.api == "fsdp2":
            torch.nn.utils.clip_grad_norm_(fsdp.parameters(), 1.0)  # DTensor shards: one all-reduce of norms
        else:
            fsdp.clip_grad_norm_(1.0)
        opt.step()
        losses.append(loss.item())
        step_ms.append((time.perf_counter() - start) * 1e3)
        in_use_peak = max(in_use_peak, malloc_in_use())
        if step + 1 == args.steps:  # gradients still held: the state at the step's end
            states = fsdp2_state_bytes(fsdp, opt) if args.api == "fsdp2" else model_state_bytes(fsdp, opt)
        opt.zero_grad(set_to_none=True)
    figures = step_figures(step_ms[args.skip:], world * args.micro_batch * t)
    warmup_s = (sum(step_ms[:args.skip]) - args.skip * figures["step_ms"]) / 1e3
    mine = {
        "rank": rank,
        "peak_rss_bytes": status_bytes("VmHWM"),
        "malloc_in_use_peak_bytes": in_use_peak,
        "model_states": states,
        "model_states_total": sum(states.values()),
        "step_ms": figures["step_ms"],
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        print(json.dumps({
            "peer": ("pytorch-fsdp2-" if args.api == "fsdp2" else "pytorch-fsdp-") + args.sharding.replace("_", "-"),
            "api": args.api,
            "torch": torch.__version__,
            "backend": "gloo",
            "sharding": args.sharding,
            "world_size": world,
            "threads": torch.get_num_threads(),
            "attention": attention,
            "precision": args.precision,
            "model": cfg,
            "n_params": n_params,
            "fsdp_units": n_units,
            "forward_prefetch": args.forward_prefetch,
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "steps": args.steps,
            **figures,
            "warmup_s": warmup_s,
            "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "ranks": ranks,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
