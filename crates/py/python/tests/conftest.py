"""Shared fixtures: a prepared token dataset, the repository's trace fixtures, the stoke and
stoke-trace binaries (paths from STOKE_BIN and STOKE_TRACE_BIN, which `cargo xtask test` sets)."""

import os
import pathlib
import shutil

import pytest

import stoke

REPO = pathlib.Path(__file__).resolve().parents[4]
TRACES = REPO / "crates" / "prof" / "tests" / "fixtures" / "traces"

# The tests are of the installed wheel, never of the source tree beside them.
assert not pathlib.Path(stoke.__file__).resolve().is_relative_to(REPO / "crates"), (
    f"stoke was imported from the source tree ({stoke.__file__}); install the wheel"
)


def corpus_text(n_docs: int = 400) -> str:
    words = "the quick brown fox jumps over a lazy dog while stoke loads tokens and counts them".split()
    return "".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(20 + i % 13)) + ".\n" for i in range(n_docs))


@pytest.fixture
def prepared(tmp_path: pathlib.Path) -> pathlib.Path:
    """A small byte-level dataset in two shards (so rows cross shard ends)."""
    text = tmp_path / "corpus.txt"
    text.write_text(corpus_text())
    out = tmp_path / "prepared"
    stoke.prep.text([text], out, shard_tokens=20_000)
    return out


@pytest.fixture(scope="session")
def stoke_trace() -> str:
    path = os.environ.get("STOKE_TRACE_BIN") or shutil.which("stoke-trace")
    if not path:
        for profile in ("release", "debug"):
            candidate = REPO / "target" / profile / "stoke-trace"
            if candidate.exists():
                path = str(candidate)
                break
    assert path, "no stoke-trace binary: set STOKE_TRACE_BIN or build it (cargo build --bin stoke-trace)"
    return path


@pytest.fixture(scope="session")
def stoke_bin() -> str:
    path = os.environ.get("STOKE_BIN") or shutil.which("stoke")
    if not path:
        for profile in ("debug", "release"):
            candidate = REPO / "target" / profile / "stoke"
            if candidate.exists():
                path = str(candidate)
                break
    assert path, "no stoke binary: set STOKE_BIN or build it (cargo build --bin stoke)"
    return path


@pytest.fixture(scope="session")
def traces() -> pathlib.Path:
    assert TRACES.is_dir(), f"{TRACES} is missing (the trace fixtures of crates/prof)"
    return TRACES
