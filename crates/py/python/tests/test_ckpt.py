"""stoke.ckpt: a state_dict saved in the background loads back equal, a kill during a save leaves
the committed checkpoints whole and no partial one visible, damage is an error naming the file."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import stoke


def state(step: int, n: int = 1000):
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(n, 3, generator=g),
        "w_bf16": torch.randn(7, n, generator=g).to(torch.bfloat16),
        "idx": torch.arange(n, dtype=torch.int64) * step,
        "scalar": torch.tensor(float(step)),
        "empty": torch.zeros(0, 4),
        "layer.0.weight": torch.randn(4, 5, generator=g).t(),  # not contiguous: saved as its values
    }


def assert_equal_state(got, expected):
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_save_in_the_background_then_load_gives_equal_tensors(tmp_path):
    expected = state(3)
    pending = stoke.ckpt.save(expected, tmp_path, step=3, meta={"epoch": 1, "note": "x"})
    expected_copy = {k: v.clone() for k, v in expected.items()}
    for tensor in expected.values():  # the save has copied them: changing them now changes nothing
        tensor.zero_() if tensor.numel() else None
    committed = pending.wait()
    assert [c["step"] for c in committed] == [3]
    assert stoke.ckpt.steps(tmp_path) == [3]
    loaded = stoke.ckpt.read(tmp_path)
    assert loaded.step == 3 and loaded.meta == {"epoch": 1, "note": "x"}
    assert_equal_state(loaded.files["model"], expected_copy)
    assert_equal_state(stoke.ckpt.load(tmp_path / "step-3"), expected_copy)


def test_a_writer_keeps_the_newest_steps_and_a_model_loads_them(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    with stoke.ckpt.Writer(tmp_path, keep=2) as writer:
        for step in (10, 20, 30):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            writer.save(model.state_dict(), step)
    assert stoke.ckpt.steps(tmp_path) == [20, 30]
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    fresh.load_state_dict(stoke.ckpt.load(tmp_path))
    x = torch.randn(5, 8)
    assert torch.equal(fresh(x), model(x))


def test_the_files_are_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    expected = state(4)
    stoke.ckpt.save(expected, tmp_path, step=4).wait()
    assert_equal_state(safetensors_torch.load_file(str(tmp_path / "step-4" / "model.safetensors")), expected)


def test_unsupported_values_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="lr"):
        stoke.ckpt.Writer(tmp_path).save({"w": torch.ones(2), "lr": 0.1}, 1)
    with pytest.raises(TypeError, match="half"):
        stoke.ckpt.Writer(tmp_path).save({"half": torch.ones(2, dtype=torch.float16)}, 1)


CHILD = r"""
import sys, torch, stoke.ckpt
def state(step):
    return {"w": torch.full((4 << 20,), float(step)), "b": torch.full((999,), step, dtype=torch.bfloat16),
            "i": torch.arange(10) + step}
writer = stoke.ckpt.Writer(sys.argv[1], keep=0)
writer.save(state(1), 1)
writer.wait()
print("committed 1", flush=True)
step = 2
while True:
    writer.save(state(step), step)
    print(f"saving {step}", flush=True)
    step += 1
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.03, 0.1, 0.3])
def test_sigkill_during_a_save_leaves_committed_checkpoints_whole(tmp_path, delay_s):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "committed 1"
        assert child.stdout.readline().strip() == "saving 2"
        time.sleep(delay_s)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    committed = stoke.ckpt.steps(tmp_path)
    assert committed[0] == 1
    visible = sorted(int(name[5:]) for name in os.listdir(tmp_path) if name.startswith("step-"))
    assert visible == committed, "a step folder that is not a complete checkpoint is visible"
    for step in committed:
        loaded = stoke.ckpt.load(tmp_path, step)
        assert torch.equal(loaded["w"], torch.full((4 << 20,), float(step)))
        assert torch.equal(loaded["b"], torch.full((999,), step, dtype=torch.bfloat16))
        assert torch.equal(loaded["i"], torch.arange(10) + step)


def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path):
    stoke.ckpt.save(state(1), tmp_path, step=1).wait()
    tensors = tmp_path / "step-1" / "model.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(stoke.CheckpointError, match="model.safetensors"):
        stoke.ckpt.load(tmp_path, 1)

    stoke.ckpt.save(state(2), tmp_path, step=2).wait()
    manifest = tmp_path / "step-2" / "manifest.json"
    manifest.write_text(json.dumps({"format_version": 1, "step": 2}))
    with pytest.raises(stoke.CheckpointError, match="manifest.json"):
        stoke.ckpt.load(tmp_path / "step-2")
    with pytest.raises(stoke.CheckpointError, match="no committed checkpoint"):
        stoke.ckpt.load(tmp_path / "empty")


def test_a_stoke_run_checkpoint_reads_into_state_dicts(stoke_bin, tmp_path):
    """What the Rust trainer commits reads back whole: model and optimizer files, the manifest's
    meta (data position, config), the same tensors safetensors reads."""
    run = subprocess.run(
        [stoke_bin, "train", "--set", "train.steps=2", "--set", "ckpt.every=1", "--set", "run.name=py"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    checkpoints = tmp_path / "runs" / "py" / "checkpoints"
    assert stoke.ckpt.steps(checkpoints) == [1, 2]
    saved = stoke.ckpt.read(checkpoints)
    assert saved.step == 2 and saved.meta["step"] == 2 and "data_position" in saved.meta
    assert set(saved.files) >= {"model", "optim"}
    assert all(t.dtype == torch.float32 for t in saved.files["model"].values())
    assert any(name.endswith(".exp_avg") for name in saved.files["optim"])
    safetensors_torch = pytest.importorskip("safetensors.torch")
    on_disk = safetensors_torch.load_file(str(checkpoints / "step-2" / "model.safetensors"))
    assert_equal_state(saved.files["model"], on_disk)
