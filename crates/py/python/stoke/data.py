"""Batches for a PyTorch loop from prepared data, filled by stoke's Rust loader.

A :class:`TokenLoader` cuts rows of ``seq_len + 1`` tokens from a prepared dataset (``stoke prep
text`` or :func:`stoke.prep.text`), a Megatron-LM ``.bin``/``.idx`` pair or a raw nanoGPT/llm.c
token file. Sample ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``; the order is a pure
function of ``(seed, epoch, index)``; rank ``r`` of ``world_size`` takes rows ``r*batch_size..`` of
each global batch; worker threads fill batches ahead, with the GIL released. Its state is one
integer (the global samples consumed), so :meth:`TokenLoader.load_state_dict` resumes exactly,
also at another world size. Iteration never ends: epochs follow each other (see
:attr:`TokenLoader.batches_per_epoch`).

Each batch is a tensor viewing the loader's own buffer (no copy); the buffer goes back to the
loader when the last tensor viewing it is freed.

>>> loader = TokenLoader("data/prepared", seq_len=256, batch_size=16)   # doctest: +SKIP
>>> batch = next(loader)                      # int64 [16, 257]
>>> x, y = batch[:, :-1], batch[:, 1:]
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, Optional

from . import _native
from ._convert import converter


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class TokenLoader:
    """Batches of token rows, ``[batch_size, seq_len + 1]`` int64.

    ``rank`` and ``world_size`` default to torchrun's ``RANK`` and ``WORLD_SIZE`` (else 0 and 1).
    ``workers`` threads fill ``prefetch`` batches ahead (0 workers: each batch is cut when asked).
    ``drop_last`` skips an epoch's tail that cannot fill a global batch. ``output`` is ``"torch"``,
    ``"numpy"`` or ``"dlpack"``.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        workers: int = 2,
        prefetch: int = 4,
        drop_last: bool = True,
        output: str = "torch",
    ) -> None:
        rank = _env_int("RANK", 0) if rank is None else rank
        world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        self._convert = converter(output)
        self._native = _native.TokenLoader(
            os.fspath(path),
            seq_len,
            batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            workers=workers,
            prefetch=prefetch,
            drop_last=drop_last,
        )
        self.seq_len, self.batch_size, self.rank, self.world_size = seq_len, batch_size, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self._convert(self._native.next_buffer())

    def state_dict(self) -> Dict[str, int]:
        """The resume state: ``{"seed", "epoch", "samples_consumed"}``; the next batch of a loader
        given it by :meth:`load_state_dict` is the one this loader would yield next."""
        return dict(self._native.state())

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continues from :meth:`state_dict`'s result (batches prepared ahead are dropped)."""
        self._native.load_state(dict(state))

    @property
    def n_tokens(self) -> int:
        """Tokens in the dataset."""
        return self._native.n_tokens

    @property
    def batches_per_epoch(self) -> int:
        """Batches of this rank per epoch."""
        per_epoch = self._native.samples_per_epoch or 0
        return per_epoch // (self.batch_size * self.world_size)

    def stats(self) -> Dict[str, int]:
        """``{"batches", "waited"}``: batches handed out, and how many were not ready when asked."""
        batches, waited = self._native.stats()
        return {"batches": batches, "waited": waited}


class EpisodeLoader:
    """Batches of robot-episode samples from a prepared directory (``stoke prep episodes`` or
    :func:`stoke.prep.episodes`): a dict of ``frames`` ``[B, F, S, S, 3]`` uint8 (``F`` = cameras x
    ``(history + 1)``, cropped and colour-jittered when ``augment``; ``[B, F, 3, S, S]`` with
    ``channels_first``, transposed by the worker threads), ``state`` ``[B, state_dim]``
    and ``actions`` ``[B, chunk, action_dim]`` float32 (normalized), ``action_mask`` ``[B, chunk]``
    and ``token_mask`` ``[B, max_tokens]`` uint8, ``tokens`` ``[B, max_tokens]`` and ``steps``
    ``[B]`` int64. Order, rank split and resume as :class:`TokenLoader`'s.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        batch_size: int,
        *,
        seed: int = 1337,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        chunk: int = 8,
        history: int = 0,
        resolution: int = 0,
        augment: bool = True,
        max_tokens: int = 32,
        workers: int = 2,
        prefetch: int = 4,
        verify: bool = True,
        channels_first: bool = False,
        output: str = "torch",
    ) -> None:
        rank = _env_int("RANK", 0) if rank is None else rank
        world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        self._convert = converter(output)
        self._native = _native.EpisodeBatches(
            os.fspath(path),
            batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            chunk=chunk,
            history=history,
            resolution=resolution,
            augment=augment,
            max_tokens=max_tokens,
            workers=workers,
            prefetch=prefetch,
            verify=verify,
            channels_first=channels_first,
        )

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return self

    def __next__(self) -> Dict[str, Any]:
        return {name: self._convert(buffer) for name, buffer in self._native.next_buffers().items()}

    def state_dict(self) -> Dict[str, int]:
        """The resume state: ``{"seed", "samples_consumed"}``."""
        return dict(self._native.state())

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self._native.load_state(dict(state))

    @property
    def n_steps(self) -> int:
        """Time steps (samples) in the dataset."""
        return self._native.n_steps


__all__ = ["TokenLoader", "EpisodeLoader"]
