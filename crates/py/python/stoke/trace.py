"""PyTorch profiler (Kineto) traces analyzed by stoke's analyzer (the one behind ``stoke trace``),
with the GIL released: per step where the time went (categories summing to the step's wall
time), GPU idle and kernel breakdowns as HTA computes them, launch statistics, cross-rank
stragglers and findings, as plain dicts equal to ``stoke trace analyze --format json``'s output.

>>> report = analyze("traces/")                     # doctest: +SKIP
>>> report["ranks"][0]["steps"][0]["categories"]    # doctest: +SKIP
>>> frames(report)["steps"]                         # pandas, when installed  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _native

PathLike = Union[str, "os.PathLike[str]"]


def _paths(inputs: Union[PathLike, Sequence[PathLike]]) -> List[str]:
    if isinstance(inputs, (str, os.PathLike)):
        return [os.fspath(inputs)]
    return [os.fspath(p) for p in inputs]


def analyze(
    inputs: Union[PathLike, Sequence[PathLike]],
    *,
    top: int = 10,
    model_flops: Optional[float] = None,
    peak_flops: Optional[float] = None,
) -> Dict[str, Any]:
    """Analyzes trace files (``.json`` or ``.json.gz``) or folders of them, one file per rank.
    ``top`` kernels are listed; ``model_flops`` (per step, forward + backward, per rank) and
    ``peak_flops`` (of one device; default from its name) give MFU."""
    text = _native.analyze(_paths(inputs), "json", top, model_flops, peak_flops)
    return json.loads(text)


def report(inputs: Union[PathLike, Sequence[PathLike]], *, format: str = "table", top: int = 10) -> str:
    """The analysis as ``stoke trace analyze`` prints it: ``"table"``, ``"markdown"`` or
    ``"prometheus"``."""
    return _native.analyze(_paths(inputs), format, top, None, None)


def diff(base: PathLike, new: PathLike, *, tolerance: float = 0.05, top: int = 20) -> Dict[str, Any]:
    """Compares two sets of traces (a file or folder each), as ``stoke trace diff --format json``;
    ``result["regression"]`` says whether the new step time regressed beyond ``tolerance``
    (widened by noisy steps)."""
    return json.loads(_native.compare(os.fspath(base), os.fspath(new), "json", tolerance, top))


def frames(analysis: Dict[str, Any]) -> Dict[str, Any]:
    """An analysis as pandas DataFrames: ``steps`` (one row per rank and step, each category's
    nanoseconds as a column), ``kernels`` (the kernel breakdown per rank) and ``findings`` (per
    rank and step). Needs pandas."""
    import pandas as pd

    steps, kernels, findings = [], [], []
    for rank in analysis.get("ranks", []):
        rank_idx = rank.get("rank")
        for step in rank.get("steps", []):
            row = {"rank": rank_idx}
            row.update({k: v for k, v in step.items() if not isinstance(v, (dict, list))})
            for name, ns in (step.get("categories") or {}).items():
                row[f"{name}_ns"] = ns
            steps.append(row)
            for finding in step.get("findings", []):
                findings.append({"rank": rank_idx, "step": step.get("step"), **_flat(finding)})
        for finding in rank.get("findings", []):
            findings.append({"rank": rank_idx, "step": None, **_flat(finding)})
        for kernel in rank.get("top_kernels", []) or []:
            kernels.append({"rank": rank_idx, **_flat(kernel)})
    return {"steps": pd.DataFrame(steps), "kernels": pd.DataFrame(kernels), "findings": pd.DataFrame(findings)}


def _flat(record: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in record.items() if not isinstance(v, (dict, list))}


__all__ = ["analyze", "report", "diff", "frames"]
