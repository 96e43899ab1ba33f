"""Offline preparation, as ``stoke prep``: text into token shards, robot episodes into a prepared
directory. Each writes into a fresh folder beside ``out`` and moves it into place only once
complete; an ``out`` that holds anything is refused unless ``force`` (then replaced whole).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Sequence, Union

from . import _native

PathLike = Union[str, "os.PathLike[str]"]


def text(
    inputs: Union[PathLike, Sequence[PathLike]],
    out: PathLike,
    *,
    tokenizer: str = "bytes",
    eos: str = "",
    shard_tokens: int = 1 << 28,
    threads: int = 2,
    force: bool = False,
) -> Dict[str, Any]:
    """Tokenizes ``.txt`` files (one document each) and ``.jsonl`` files (one per line's
    ``"text"``) into ``shard-NNNNN.bin`` token shards with ``.idx`` document offsets and a
    ``manifest.json`` (CRC-32 per file), which is returned. ``tokenizer`` is ``"bytes"`` or the
    path of a HuggingFace ``tokenizer.json``; ``eos`` a token text appended after each document."""
    paths = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    manifest = _native.text(
        paths, os.fspath(out), tokenizer=tokenizer, eos=eos, shard_tokens=shard_tokens, threads=threads, force=force
    )
    return json.loads(manifest)


def episodes(
    source: PathLike,
    out: PathLike,
    *,
    resolution: int = 64,
    keep_encoded: bool = False,
    tokenizer: str = "bytes",
    force: bool = False,
) -> Dict[str, Any]:
    """Prepares robot episodes from the JSON-lines layout (one line per time step) in ``source``:
    frames decoded and resized to ``resolution`` once (or kept encoded), state and action
    statistics, instruction tokens, CRC-32s. Returns the manifest."""
    manifest = _native.episodes(
        os.fspath(source), os.fspath(out), resolution=resolution, keep_encoded=keep_encoded,
        tokenizer=tokenizer, force=force,
    )
    return json.loads(manifest)


def verify(path: PathLike) -> Dict[str, Any]:
    """Checks every file of a prepared token dataset (sizes, CRC-32s, indexes); returns its
    manifest or raises :class:`stoke.DataError` naming the damaged file."""
    return json.loads(_native.verify(os.fspath(path)))


def synthetic_episodes(
    out: PathLike, *, n_episodes: int = 64, steps_per_episode: int = 16, resolution: int = 64, seed: int = 1337
) -> int:
    """Writes stoke's built-in robot episodes (real JPEG frames) in the JSON-lines layout;
    returns the number of time steps."""
    return _native.synthetic_episodes(
        os.fspath(out), n_episodes=n_episodes, steps_per_episode=steps_per_episode, resolution=resolution, seed=seed
    )


__all__ = ["text", "episodes", "verify", "synthetic_episodes"]
