"""Peer (b): nanoGPT's get_batch, as in its train.py: a fresh np.memmap of the uint16 token file per
batch, random offsets, x and y stacked from int64 copies (pinned and moved only on CUDA). Prints one
JSON line.

Usage: data_nanogpt.py --bin shard-00000.bin --batch 16 --seq 1024 --steps 2000
"""
import argparse
import json
import time

import numpy as np
import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block_size, batch_size = args.seq, args.batch
    torch.manual_seed(1)

    def get_batch():
        # We recreate np.memmap every batch to avoid a memory leak, as nanoGPT does.
        data = np.memmap(args.bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
        if device == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    t0 = time.perf_counter()
    x, y = get_batch()
    first_batch_s = time.perf_counter() - t0
    assert x.shape == (batch_size, block_size)
    for _ in range(args.warmup):
        get_batch()
    checksum = 0
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = get_batch()
        checksum ^= int(x[0, 0])
    seconds = time.perf_counter() - start
    print(json.dumps({
        "peer": "nanoGPT np.memmap get_batch",
        "tokens_per_s": args.steps * batch_size * block_size / seconds,
        "first_batch_s": first_batch_s,
        "checksum": checksum,
    }))


if __name__ == "__main__":
    main()
