"""Checkpoints of a PyTorch ``state_dict`` through stoke's writer, and stoke checkpoints read
back.

:func:`save` copies the tensors into a host buffer (the only part the caller waits for) and
returns; a background thread writes the safetensors file, fsyncs it and the manifest (sizes and
CRC-32s), and commits the step by renaming a complete ``step-<n>/`` folder into place, so a kill
at any moment leaves the previous checkpoints whole and no partial one visible. :func:`load`
checks every CRC-32 and returns tensors that view the bytes read (no second copy). The files are
safetensors, so ``safetensors.torch.load_file`` reads them too.

>>> pending = save(model.state_dict(), "ckpt", step=100)    # doctest: +SKIP
>>> pending.wait()                                          # doctest: +SKIP
>>> model.load_state_dict(load("ckpt"))                     # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Union

from . import _native
from ._convert import converter

PathLike = Union[str, "os.PathLike[str]"]


def _tensors(state_dict: Mapping[str, Any]) -> List[Any]:
    import torch

    out = []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: {type(value).__name__} is not a tensor; put plain values in meta=")
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        out.append((str(name), tensor.contiguous()))
    return out


class Writer:
    """The writer of one checkpoint folder. ``keep`` newest steps are kept (0: all), and every
    multiple of ``keep_every``; ``buffers`` host buffers let a save proceed while earlier ones are
    written (a save waits when all are busy); ``background=False`` writes inside :meth:`save`."""

    def __init__(
        self, dir: PathLike, *, keep: int = 3, keep_every: int = 0, buffers: int = 2, background: bool = True
    ) -> None:
        self.dir = os.fspath(dir)
        self._native = _native.Writer(self.dir, keep=keep, keep_every=keep_every, buffers=buffers, background=background)

    def save(self, state_dict: Mapping[str, Any], step: int, *, meta: Optional[Dict[str, Any]] = None) -> float:
        """Saves float32, bfloat16 and int64 tensors as checkpoint ``step`` with ``meta`` (any
        JSON) in the manifest; returns the seconds waited for a free host buffer. The tensors may
        change as soon as this returns."""
        meta_json = None if meta is None else json.dumps(meta)
        return self._native.save(step, _tensors(state_dict), meta_json)

    def wait(self) -> List[Dict[str, Any]]:
        """Waits until every saved step is committed; returns them (``step``, ``path``,
        ``bytes``, ``write_s``, ``deleted``) as not reported before."""
        return self._native.wait()

    def close(self) -> List[Dict[str, Any]]:
        """Waits, then stops the writer thread."""
        return self._native.close()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_writers: Dict[str, Writer] = {}
_writers_lock = threading.Lock()


class PendingSave:
    """A save in progress; :meth:`wait` returns once it (and the folder's earlier saves) are
    committed."""

    def __init__(self, writer: Writer, step: int, stall_s: float) -> None:
        self.writer, self.step, self.stall_s = writer, step, stall_s

    def wait(self) -> List[Dict[str, Any]]:
        return self.writer.wait()


def save(
    state_dict: Mapping[str, Any], dir: PathLike, step: int = 0, *, meta: Optional[Dict[str, Any]] = None, keep: int = 3
) -> PendingSave:
    """Saves ``state_dict`` as ``<dir>/step-<step>/`` in the background (see :class:`Writer`;
    one writer per folder lives until :func:`wait` or interpreter exit, which waits for it)."""
    key = os.path.realpath(os.fspath(dir))
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = Writer(key, keep=keep)
    return PendingSave(writer, step, writer.save(state_dict, step, meta=meta))


@atexit.register
def wait() -> None:
    """Waits for every :func:`save` in flight and stops their writers."""
    with _writers_lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        writer.close()


class Checkpoint(NamedTuple):
    step: int
    meta: Any
    #: ``{file stem: {tensor name: tensor}}``; a ``state_dict`` saved here is ``files["model"]``,
    #: a stoke run's checkpoint also has ``optim`` (and under data parallelism ``dist``).
    files: Dict[str, Dict[str, Any]]


def read(path: PathLike, step: Optional[int] = None, *, output: str = "torch") -> Checkpoint:
    """Reads and verifies a checkpoint: ``path`` is a ``step-<n>`` folder or a folder of them
    (``step``, else the newest committed). Raises :class:`stoke.CheckpointError` naming the file
    on a missing or malformed manifest, a short file or a CRC-32 mismatch."""
    convert = converter(output)
    got_step, meta_json, files = _native.load(os.fspath(path), step)
    tensors = {stem: {name: convert(buffer) for name, buffer in pairs} for stem, pairs in files.items()}
    return Checkpoint(got_step, json.loads(meta_json), tensors)


def load(path: PathLike, step: Optional[int] = None, *, stem: str = "model", output: str = "torch") -> Dict[str, Any]:
    """The ``state_dict`` of file ``stem`` of a checkpoint (see :func:`read`)."""
    files = read(path, step, output=output).files
    if stem not in files:
        raise _native.CheckpointError(f"{os.fspath(path)}: the checkpoint has no file {stem!r} (it has {sorted(files)})")
    return files[stem]


def steps(path: PathLike) -> List[int]:
    """Committed steps in a checkpoint folder, oldest first."""
    return _native.steps(os.fspath(path))


__all__ = ["Writer", "PendingSave", "Checkpoint", "save", "wait", "read", "load", "steps"]
