"""How a DLPack buffer from the native module becomes what the caller asked for."""

from __future__ import annotations

from typing import Any, Callable


def converter(output: str) -> Callable[[Any], Any]:
    """``"torch"``: a ``torch.Tensor`` (zero-copy); ``"numpy"``: a ``numpy.ndarray`` (zero-copy);
    ``"dlpack"``: the buffer itself, for any DLPack consumer."""
    if output == "torch":
        import torch

        return torch.from_dlpack
    if output == "numpy":
        import numpy

        return numpy.from_dlpack
    if output == "dlpack":
        return lambda buffer: buffer
    raise ValueError(f"output {output!r}: expected 'torch', 'numpy' or 'dlpack'")
