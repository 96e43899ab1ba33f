"""stoke for PyTorch training loops: stoke's data loader, trace analyzer, checkpoint writer and
offline data preparation, from Python, with the GIL released while they work.

- ``stoke.data``: batches from prepared token shards or episode records, as zero-copy tensors,
  in the same order, rank split and exact resume as stoke's own loader.
- ``stoke.trace``: PyTorch profiler (Kineto) traces analyzed and compared, as dicts (and pandas
  DataFrames), the same findings as ``stoke trace``.
- ``stoke.ckpt``: a ``state_dict`` saved in the background, atomically, with CRC-32s; checkpoints
  (also the trainer's) read back into tensors, every CRC-32 checked.
- ``stoke.prep``: text and robot episodes prepared once into shards.

Every error is a :class:`StokeError` (``DataError``, ``TraceError``, ``CheckpointError``) whose
message is the Rust error's, naming the file.
"""

from importlib.metadata import PackageNotFoundError, version

from ._native import CheckpointError, DataError, StokeError, TraceError
from . import ckpt, data, prep, trace

try:
    __version__ = version("stoke")
except PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"

__all__ = ["StokeError", "DataError", "TraceError", "CheckpointError", "ckpt", "data", "prep", "trace"]
