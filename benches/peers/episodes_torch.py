"""The PyTorch peer of `stoke bench episodes`: a DataLoader over the same robot episodes (the JSON
lines and JPEG files `stoke corpus --episodes` writes), as a robot-learning user would write it:
each step's frame read and decoded by torchvision (libjpeg-turbo), then transforms.v2's
RandomResizedCrop and ColorJitter with the same ranges as stoke's loader, state and action chunk as
tensors, shuffled, `--workers` worker processes with persistent workers and prefetching. Prints one
JSON line with frames per second over `--batches` batches after `--warmup`.
"""

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import decode_jpeg, read_file
from torchvision.transforms import v2

from _measure import forever


class Episodes(Dataset):
    def __init__(self, root, side, chunk):
        self.root = root
        with open(os.path.join(root, "episodes.jsonl")) as f:
            self.steps = [json.loads(line) for line in f if line.strip()]
        # Index of each step's episode run, for the action chunk.
        self.chunk = chunk
        self.transform = v2.Compose(
            [
                v2.RandomResizedCrop(side, scale=(0.8, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
                v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
            ]
        )

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        step = self.steps[i]
        frames = []
        for camera in sorted(step["images"]):
            data = read_file(os.path.join(self.root, step["images"][camera]))
            frames.append(self.transform(decode_jpeg(data)))
        actions, mask = [], []
        for k in range(self.chunk):
            j = i + k
            same = j < len(self.steps) and self.steps[j]["episode"] == step["episode"]
            actions.append(self.steps[j]["action"] if same else [0.0] * len(step["action"]))
            mask.append(1 if same else 0)
        return (
            torch.stack(frames),
            torch.tensor(step["state"], dtype=torch.float32),
            torch.tensor(actions, dtype=torch.float32),
            torch.tensor(mask, dtype=torch.uint8),
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the main process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = Episodes(args.data, args.side, args.chunk)
    loader = DataLoader(
        dataset,
        batch_size=args.micro_batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(1337),
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        prefetch_factor=4 if args.workers > 0 else None,
        drop_last=True,
    )
    batches = forever(loader)
    for _ in range(args.warmup):
        next(batches)
    frames = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        batch = next(batches)
        frames += batch[0].shape[0] * batch[0].shape[1]
    wall = time.perf_counter() - start
    print(json.dumps({"loader": "torch", "workers": args.workers, "batches": args.batches, "frames": frames,
                      "wall_s": wall, "frames_per_s": frames / wall}))


if __name__ == "__main__":
    main()
