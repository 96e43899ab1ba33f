"""Damaged or missing data is a Python exception whose message names the file."""

import json

import pytest

import stoke
from stoke.data import TokenLoader


def test_a_corrupt_shard_stops_the_loader_naming_it(prepared):
    shard = prepared / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    loader = TokenLoader(prepared, 32, 4, seed=0)
    with pytest.raises(stoke.DataError, match="shard-00000.bin"):
        for _ in range(1000):
            next(loader)
    with pytest.raises(stoke.DataError, match="shard-00000.bin"):
        stoke.prep.verify(prepared)


def test_a_bad_manifest_is_an_error_naming_it(prepared):
    manifest = prepared / "manifest.json"
    manifest.write_text(json.dumps({"format": "stoke-tokens"}))
    with pytest.raises(stoke.DataError, match="manifest.json"):
        TokenLoader(prepared, 32, 4)


def test_a_missing_dataset_is_an_error_naming_it(tmp_path):
    with pytest.raises(stoke.DataError, match="nowhere"):
        TokenLoader(tmp_path / "nowhere", 32, 4)


def test_a_bad_loader_config_is_an_error_naming_the_field(prepared):
    with pytest.raises(stoke.DataError, match="rank"):
        TokenLoader(prepared, 32, 4, rank=2, world_size=2)


def test_prep_refuses_a_folder_that_holds_anything(prepared, tmp_path):
    text = tmp_path / "corpus.txt"
    with pytest.raises(stoke.DataError, match="force=True"):
        stoke.prep.text([text], prepared)
    manifest = stoke.prep.text([text], prepared, force=True)
    assert manifest["format"] == "stoke-tokens"


def test_every_error_is_a_stoke_error():
    for error in (stoke.DataError, stoke.TraceError, stoke.CheckpointError):
        assert issubclass(error, stoke.StokeError) and issubclass(error, Exception)
