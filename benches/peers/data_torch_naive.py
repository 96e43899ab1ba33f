"""Peer (a): the usual naive pipeline. A map-style Dataset that tokenizes each sample when asked
(byte-level, the cheapest tokenizer there is, so this peer is flattered), a PyTorch DataLoader with
num_workers=2 and pin_memory=True, shuffle, drop_last. Prints one JSON line.

Usage: data_torch_naive.py --text corpus.txt --batch 16 --seq 1024 --steps 200
"""
import argparse
import time
import warnings

import torch

from _measure import measure
from torch.utils.data import DataLoader, Dataset


class TextWindows(Dataset):
    def __init__(self, path, seq):
        with open(path, encoding="utf-8") as f:
            self.text = f.read()
        self.seq = seq
        self.n = (len(self.text) - 1) // seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.seq
        ids = list(self.text[start : start + self.seq + 1].encode("utf-8"))
        return torch.tensor(ids, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    torch.manual_seed(1)
    t0 = time.perf_counter()
    dataset = TextWindows(args.text, args.seq)
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        num_workers=2,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    peer = "torch DataLoader, per-sample tokenization, 2 workers, pin_memory"
    measure(loader, t0, args, peer, pin_memory_active=torch.cuda.is_available())


if __name__ == "__main__":
    main()
