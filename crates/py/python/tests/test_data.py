"""stoke.data in a PyTorch loop: exact resume mid-epoch, the rank split, determinism, and batches
that stay valid as long as a tensor views them."""

import copy
import gc

import pytest
import torch

import stoke
from stoke.data import EpisodeLoader, TokenLoader

SEQ, BATCH = 32, 4


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def train(model: Tiny, loader: TokenLoader, n_steps: int):
    """SGD steps on the loader's batches (plain SGD: the model is the whole training state)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    for _, batch in zip(range(n_steps), loader):
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(batch.clone())
        losses.append(loss.item())
    return seen, losses


def test_a_loop_stopped_mid_epoch_resumes_with_the_same_batches_and_losses(prepared, tmp_path):
    loader = TokenLoader(prepared, SEQ, BATCH, seed=7)
    n_steps, stop = 3 * loader.batches_per_epoch // 2, loader.batches_per_epoch // 2
    assert 0 < stop < loader.batches_per_epoch < n_steps
    whole_batches, whole_losses = train(Tiny(), loader, n_steps)

    first = TokenLoader(prepared, SEQ, BATCH, seed=7)
    model = Tiny()
    head_batches, head_losses = train(model, first, stop)
    stoke.ckpt.save(model.state_dict(), tmp_path / "ckpt", step=stop, meta={"data": first.state_dict()}).wait()
    del first, model

    saved = stoke.ckpt.read(tmp_path / "ckpt")
    resumed = TokenLoader(prepared, SEQ, BATCH, seed=7)
    resumed.load_state_dict(saved.meta["data"])
    model = Tiny()
    model.load_state_dict(saved.files["model"])
    tail_batches, tail_losses = train(model, resumed, n_steps - stop)

    for step, (a, b) in enumerate(zip(whole_batches, head_batches + tail_batches)):
        assert torch.equal(a, b), f"batch {step} differs after the resume"
    assert whole_losses == head_losses + tail_losses


def test_ranks_take_their_rows_of_each_global_batch(prepared):
    whole = TokenLoader(prepared, SEQ, 2 * BATCH, seed=3, world_size=1, rank=0)
    ranks = [TokenLoader(prepared, SEQ, BATCH, seed=3, world_size=2, rank=r) for r in range(2)]
    for _ in range(10):
        assert torch.equal(next(whole), torch.cat([next(ranks[0]), next(ranks[1])]))
    # The state counts samples of all ranks, so it resumes at another world size.
    state = ranks[0].state_dict()
    assert state["samples_consumed"] == whole.state_dict()["samples_consumed"]
    again = TokenLoader(prepared, SEQ, 2 * BATCH, seed=3)
    again.load_state_dict(state)
    assert torch.equal(next(again), torch.cat([next(ranks[0]), next(ranks[1])]))


def test_order_is_a_function_of_the_seed_and_workers_do_not_change_it(prepared):
    def first(seed, workers):
        loader = TokenLoader(prepared, SEQ, BATCH, seed=seed, workers=workers)
        return [next(loader) for _ in range(20)]

    reference = first(1, 0)
    for workers in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(reference, first(1, workers)))
    assert not all(torch.equal(a, b) for a, b in zip(reference, first(2, 2)))


def test_rows_are_windows_of_the_data(prepared):
    text = open(prepared.parent / "corpus.txt", "rb").read()
    loader = TokenLoader(prepared, SEQ, BATCH, seed=0)
    for row in next(loader):
        assert bytes(row.tolist()) in text


def test_batches_outlive_the_loader_and_are_not_reused_while_viewed(prepared):
    loader = TokenLoader(prepared, SEQ, BATCH, seed=5, workers=2, prefetch=2)
    kept = [next(loader) for _ in range(8)]
    copies = [t.clone() for t in kept]
    views = [t[:, 1:] for t in kept]
    del kept
    for _ in range(50):  # buffers dropped above may be refilled; the views must not change
        next(loader)
    del loader
    gc.collect()
    for view, copy_ in zip(views, copies):
        assert torch.equal(view, copy_[:, 1:])


def test_a_dropped_batch_buffer_is_refilled_in_place(prepared):
    """Zero-copy both ways: the tensor views the loader's buffer, and once the tensor is freed the
    loader fills the same memory again (no allocation per batch)."""
    loader = TokenLoader(prepared, SEQ, BATCH, seed=4, workers=0)
    addresses = set()
    for _ in range(10):
        batch = next(loader)
        addresses.add(batch.data_ptr())
        del batch
    assert len(addresses) == 1


def test_numpy_output_is_the_same_batch(prepared):
    numpy = pytest.importorskip("numpy")
    as_torch = next(TokenLoader(prepared, SEQ, BATCH, seed=2))
    as_numpy = next(TokenLoader(prepared, SEQ, BATCH, seed=2, output="numpy"))
    assert isinstance(as_numpy, numpy.ndarray)
    assert (as_numpy == as_torch.numpy()).all()


def test_a_state_from_another_seed_is_refused(prepared):
    state = TokenLoader(prepared, SEQ, BATCH, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed 1"):
        TokenLoader(prepared, SEQ, BATCH, seed=2).load_state_dict(state)


def test_episode_batches_resume_exactly(tmp_path):
    source = tmp_path / "episodes-src"
    n_steps = stoke.prep.synthetic_episodes(source, n_episodes=6, steps_per_episode=8, resolution=32)
    manifest = stoke.prep.episodes(source, tmp_path / "episodes", resolution=32)
    assert manifest["n_steps"] == n_steps
    loader = EpisodeLoader(tmp_path / "episodes", 4, chunk=4, seed=9)
    batches = [next(loader) for _ in range(6)]
    assert batches[0]["frames"].shape == (4, 1, 32, 32, 3) and batches[0]["frames"].dtype == torch.uint8
    assert batches[0]["actions"].shape == (4, 4, manifest["action_dim"])
    resumed = EpisodeLoader(tmp_path / "episodes", 4, chunk=4, seed=9)
    replay = EpisodeLoader(tmp_path / "episodes", 4, chunk=4, seed=9)
    for _ in range(3):
        next(replay)
    resumed.load_state_dict(replay.state_dict())
    for expected in batches[3:]:
        got = next(resumed)
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected), "an episode batch differs after the resume"
    # Channels first: the same batches, each frame [3, S, S].
    planar = EpisodeLoader(tmp_path / "episodes", 4, chunk=4, seed=9, channels_first=True)
    for expected in batches[:2]:
        got = next(planar)
        assert got["frames"].shape == (4, 1, 3, 32, 32)
        assert torch.equal(got["frames"], expected["frames"].permute(0, 1, 4, 2, 3))
        assert all(torch.equal(got[k], expected[k]) for k in expected if k != "frames")
