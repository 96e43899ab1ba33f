"""Peer (c): mosaicml-streaming. The same token file cut into the same samples (seq+1 tokens at a
stride of seq) is written once as MDS shards (not timed), then read by StreamingDataset with
shuffling through a DataLoader with num_workers=2 and pin_memory=True. Prints one JSON line.

Usage: data_streaming.py --bin shard-00000.bin --mds <dir> --batch 16 --seq 1024 --steps 2000
"""
import argparse
import os
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader

from _measure import measure


def write_mds(bin_path, out, seq):
    from streaming import MDSWriter

    if os.path.exists(os.path.join(out, "index.json")):
        return
    tokens = np.memmap(bin_path, dtype=np.uint16, mode="r")
    n_samples = (len(tokens) - 1) // seq
    with MDSWriter(out=out, columns={"tokens": "bytes"}, size_limit=1 << 27) as writer:
        for i in range(n_samples):
            writer.write({"tokens": tokens[i * seq : i * seq + seq + 1].tobytes()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--mds", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    write_mds(args.bin, args.mds, args.seq)

    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    class Tokens(StreamingDataset):
        def __getitem__(self, idx):
            sample = super().__getitem__(idx)
            return torch.from_numpy(np.frombuffer(sample["tokens"], dtype=np.uint16).astype(np.int64))

    t0 = time.perf_counter()
    dataset = Tokens(local=args.mds, shuffle=True, shuffle_seed=1, batch_size=args.batch)
    loader = DataLoader(dataset, batch_size=args.batch, num_workers=2, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    measure(loader, t0, args, "mosaicml-streaming StreamingDataset, 2 workers, pin_memory")


if __name__ == "__main__":
    main()
