"""One PyTorch training loop, fed three ways over the same prepared data; prints one JSON line with
its rate (tokens/s, or samples/s and frames/s) and the share of the loop spent waiting for data.

``--kind tokens`` (the default) trains a byte-level model on prepared token shards; ``--kind
episodes`` trains a small vision-to-action model on robot episodes (a frame, the state, an action
chunk), with the frames decoded from JPEG and augmented at training time.

Feeds:
- ``stoke``: ``stoke.data.TokenLoader`` (the wheel), batches as zero-copy tensors.
- ``torch``: the peer, a map-style ``Dataset`` over the shards memory-mapped once with numpy, the
  sample cut stoke uses (sample ``i`` = tokens ``[i*seq, i*seq + seq + 1)`` of the concatenated
  shards), fetched a whole batch at a time through ``__getitems__`` (one fancy-indexing gather
  into an int64 array, no per-sample tensors, no stacking), shuffled by a seeded
  ``RandomSampler``, under ``DataLoader(num_workers=W, persistent_workers, pin_memory=False)``.
- ``torch-sample``: the same ``Dataset`` used the common way: ``__getitem__`` returns one row and
  the default collate stacks them.
- ``memory``: 64 batches of the same data cut before the clock starts and cycled: the loop with no
  data cost at all.

With ``--kind episodes``, ``--data`` is the JSON-lines episode layout (``stoke corpus --episodes``,
JPEG frames) and ``--prepared`` its ``stoke prep episodes --keep-encoded`` records:
- ``stoke``: ``stoke.data.EpisodeLoader`` over the records, its worker threads decoding the JPEG
  bytes, augmenting (random resized crop, colour jitter) and laying frames out channels first;
- ``torch``: a ``DataLoader`` over the JSON lines and JPEG files (benches/peers/episodes_torch.py's
  ``Episodes``: torchvision's ``decode_jpeg``, transforms.v2 ``RandomResizedCrop`` and
  ``ColorJitter`` with the same ranges), ``num_workers=W``, persistent workers;
- ``memory``: 64 of the peer's batches made before the clock starts.

Usage: py_loop.py --feed stoke|torch|torch-sample|memory --data DIR [--kind tokens|episodes]
       [--prepared DIR] [--workers W] [--batch 16 --seq 256]
"""

import argparse
import glob
import json
import os
import time

import numpy as np
import torch

from _measure import forever


class ShardTokens(torch.utils.data.Dataset):
    """Rows of ``seq + 1`` tokens from raw u16 shards, memory-mapped once per worker."""

    def __init__(self, data_dir: str, seq: int) -> None:
        self.paths = sorted(glob.glob(os.path.join(data_dir, "shard-*.bin")))
        sizes = [os.path.getsize(p) // 2 for p in self.paths]
        self.starts = np.cumsum([0] + sizes)
        self.seq = seq
        self.n_samples = (int(self.starts[-1]) - 1) // seq
        self.maps = None

    def _open(self) -> None:
        self.maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        # One array when there is one shard: a gather needs no shard lookup.
        self.flat = self.maps[0] if len(self.maps) == 1 else None

    def __len__(self) -> int:
        return self.n_samples

    def _row(self, start: int, out: np.ndarray) -> None:
        end = start + self.seq + 1
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        local = start - int(self.starts[shard])
        first = self.maps[shard][local : local + self.seq + 1]
        out[: len(first)] = first
        if len(first) < self.seq + 1:  # the row runs into the next shard
            out[len(first) :] = self.maps[shard + 1][: end - int(self.starts[shard + 1])]

    def __getitems__(self, indices):
        if self.maps is None:
            self._open()
        starts = np.asarray(indices, dtype=np.int64) * self.seq
        if self.flat is not None:
            rows = self.flat[starts[:, None] + np.arange(self.seq + 1)]
            return torch.from_numpy(rows.astype(np.int64))
        out = np.empty((len(indices), self.seq + 1), dtype=np.int64)
        for row, start in zip(out, starts):
            self._row(int(start), row)
        return torch.from_numpy(out)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]


class ShardSamples(ShardTokens):
    """The per-sample idiom: ``__getitem__`` returns one row, the default collate stacks them."""

    __getitems__ = None

    def __getitem__(self, index):
        if self.maps is None:
            self._open()
        out = np.empty(self.seq + 1, dtype=np.int64)
        self._row(index * self.seq, out)
        return torch.from_numpy(out)


def as_is(batch):
    """``__getitems__`` already returns the batch tensor."""
    return batch


def batches(args):
    if args.kind == "episodes":
        return episode_batches(args)
    if args.feed == "stoke":
        import stoke.data

        return stoke.data.TokenLoader(args.data, args.seq, args.batch, seed=1, workers=args.workers or 2)
    if args.feed in ("torch", "torch-sample"):
        per_sample = args.feed == "torch-sample"
        dataset = (ShardSamples if per_sample else ShardTokens)(args.data, args.seq)
        sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(1))
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch,
            sampler=sampler,
            drop_last=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
            pin_memory=False,
            collate_fn=None if per_sample else as_is,
        )
        return forever(loader)
    if args.feed == "memory":
        # Real rows of the same data (so the model computes on the same kind of tokens), cut
        # before the clock starts.
        dataset = ShardTokens(args.data, args.seq)
        g = torch.Generator().manual_seed(1)
        made = [dataset.__getitems__(torch.randint(0, len(dataset), (args.batch,), generator=g).tolist()) for _ in range(64)]
        return forever(made)
    raise SystemExit(f"unknown feed {args.feed}")


def episode_batches(args):
    """Batches of (frames [B, F, 3, S, S] uint8, state, actions, action mask) from either side."""
    if args.feed == "stoke":
        import stoke.data

        loader = stoke.data.EpisodeLoader(
            args.prepared,
            args.batch,
            seed=1,
            chunk=args.chunk,
            resolution=args.side,
            workers=args.workers or 2,
            channels_first=True,  # [B, F, 3, S, S], as the peer's batches
        )

        def adapt():
            for b in loader:
                yield b["frames"], b["state"], b["actions"], b["action_mask"]

        return adapt()
    from episodes_torch import Episodes

    dataset = Episodes(args.data, args.side, args.chunk)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        drop_last=True,
        num_workers=args.workers if args.feed == "torch" else 0,
        persistent_workers=args.feed == "torch" and args.workers > 0,
        prefetch_factor=4 if args.feed == "torch" and args.workers > 0 else None,
    )
    if args.feed == "torch":
        return forever(loader)
    if args.feed == "memory":
        made, it = [], iter(loader)
        for _ in range(64):
            made.append(next(it))
        return forever(made)
    raise SystemExit(f"unknown feed {args.feed} for episodes")


class Model(torch.nn.Module):
    """A byte-level next-token model: embedding, an MLP block with a residual, the head."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, d_model)
        self.up = torch.nn.Linear(d_model, hidden)
        self.down = torch.nn.Linear(hidden, d_model)
        self.head = torch.nn.Linear(d_model, 256)

    def forward(self, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        h = self.embed(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, 256), y.reshape(-1))


class VisionAction(torch.nn.Module):
    """Frames to an action chunk: patches as one strided convolution, an MLP block with a residual
    over the patches, their mean with the state's projection, a linear head; masked L1 loss."""

    def __init__(self, d_model: int, hidden: int, patch: int, state_dim: int, chunk: int, action_dim: int) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d_model, patch, stride=patch)
        self.up = torch.nn.Linear(d_model, hidden)
        self.down = torch.nn.Linear(hidden, d_model)
        self.state = torch.nn.Linear(state_dim, d_model)
        self.head = torch.nn.Linear(d_model, chunk * action_dim)

    def forward(self, batch):
        frames, state, actions, mask = batch
        b, f = frames.shape[:2]
        x = frames.flatten(0, 1).float().mul_(1 / 255)
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        h = h.mean(1).view(b, f, -1).mean(1) + self.state(state)
        err = (self.head(h).view_as(actions) - actions).abs().mean(-1) * mask
        return err.sum() / mask.sum().clamp(min=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feed", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--kind", choices=["tokens", "episodes"], default="tokens")
    ap.add_argument("--prepared", help="episodes: the records `stoke prep episodes --keep-encoded` wrote")
    ap.add_argument("--side", type=int, default=224, help="episodes: the frames' side after the crop")
    ap.add_argument("--chunk", type=int, default=8, help="episodes: actions per sample")
    ap.add_argument("--patch", type=int, default=16, help="episodes: the patch side")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    # The model's intra-op threads. One leaves the other core of a 2-core machine to the data
    # path (loader threads or DataLoader workers) and keeps OpenMP's spinning barrier out of
    # contention with them, for every feed alike.
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    it = iter(batches(args))
    first = next(it)
    if args.kind == "episodes":
        state_dim, action_dim = first[1].shape[-1], first[2].shape[-1]
        model = VisionAction(args.d_model, args.hidden, args.patch, state_dim, args.chunk, action_dim)
    else:
        model = Model(args.d_model, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wait_s, checksum = 0.0, 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            wait_s, start = 0.0, time.perf_counter()
        t = time.perf_counter()
        batch = next(it)
        wait_s += time.perf_counter() - t
        loss = model(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        checksum ^= int(batch[0].flatten()[0])
    seconds = time.perf_counter() - start
    if args.kind == "episodes":
        samples = args.steps * args.batch
        rates = {"samples_per_s": samples / seconds, "frames_per_s": samples * batch[0].shape[1] / seconds}
    else:
        rates = {"tokens_per_s": args.steps * args.batch * args.seq / seconds}
    print(json.dumps({
        "feed": args.feed,
        "kind": args.kind,
        "workers": args.workers,
        "threads": args.threads,
        **rates,
        "step_ms": 1e3 * seconds / args.steps,
        "data_wait_share": wait_s / seconds,
        "loss": loss.item(),
        "checksum": checksum,
    }), flush=True)
    os._exit(0)  # DataLoader workers and loader threads end with the process


if __name__ == "__main__":
    main()
