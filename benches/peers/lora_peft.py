"""The fine-tuning peer: transformers' LlamaForCausalLM with peft's LoRA adapters (AdamW over the
adapters only), or plain full fine-tuning in PyTorch (`--mode full`: every weight trains), on windows
of the same corpus stoke reads, the same shapes and precision; eager or `--compile`d.

  lora_peft.py --save DIR [shape flags]   write the random-init base model (stoke's model.from)
  lora_peft.py --base DIR --data FILE     fine-tune it; one JSON line: median step ms after warmup,
                                          the peak resident set, trainable parameters, losses

The step is the usual one: forward, loss, backward, optimizer step, zero_grad. bf16 runs under
torch.autocast, as a tuned PyTorch training script would. glibc keeps freed memory for the next step
(`--host-memory retain`, the default, as stoke's `train.host_memory` does). `--base-dtype bf16` loads
the frozen base in bf16 (peft keeps the adapters in fp32), so autocast has no weight of the base to
cast each step: stoke keeps a bf16 copy of its frozen weights.
"""
import argparse
import json
import resource
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from train_gpt import retain_host_memory


def base_config(args):
    return LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.d_model, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
                       max_position_embeddings=args.seq, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--save")
    p.add_argument("--base")
    p.add_argument("--data")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the frozen base's dtype under LoRA (bf16: no per-step cast of the base)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time reported apart)")
    p.add_argument("--host-memory", choices=["retain", "system"], default="retain",
                   help="retain: glibc keeps freed memory (stoke's train.host_memory default)")
    args = p.parse_args()
    if args.host_memory == "retain" and not args.save:
        retain_host_memory()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.save:
        LlamaForCausalLM(base_config(args)).save_pretrained(args.save)
        return
    base_dtype = torch.bfloat16 if args.mode == "lora" and args.base_dtype == "bf16" else torch.float32
    model = LlamaForCausalLM.from_pretrained(args.base, dtype=base_dtype, attn_implementation="sdpa")
    if args.mode == "lora":
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    data = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == 0:
            first_start = time.perf_counter()
        starts = torch.randint(0, len(data) - args.seq - 1, (args.micro_batch,), generator=generator)
        rows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(input_ids=rows[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), rows[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        if step == 0:
            first_step_s = time.perf_counter() - first_start
        losses.append(loss.item())
    side = ("transformers+peft" if args.mode == "lora" else "pytorch-full") + ("-compiled" if args.compile else "")
    print(json.dumps({"side": side, "precision": args.precision, "base_dtype": str(base_dtype).removeprefix("torch."),
                      "step_ms": statistics.median(times),
                      "first_step_s": first_step_s, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "trainable": trainable, "first_loss": losses[0], "final_loss": losses[-1]}))


if __name__ == "__main__":
    main()
