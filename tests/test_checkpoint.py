"""Checkpoints: atomic writes, keep-last-K, safe loading, fallback past a corrupt file, RNG."""

import os
import random
import stat

import numpy as np
import pytest
import torch

import microddp
from microddp import checkpoint
from microddp.errors import MicroDDPError


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"format": checkpoint.FORMAT, "model": {"w": torch.randn(3, 4, generator=g)},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "step": step, "epoch": 1, "position": 2, "sampler": {"epoch": 1, "position": 2},
            "rng": [checkpoint.rng_state()], "world_size": 2, "config": {"seed": 0}}


def test_save_load_round_trip_and_keep_last(tmp_path):
    for step in (5, 10, 15, 20):
        path = checkpoint.save(_state(step), tmp_path, step, keep=2)
        assert path == tmp_path / f"ckpt-{step:08d}.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000015.pt", "ckpt-00000020.pt"]
    state, path = checkpoint.load_latest(tmp_path)
    assert path.name == "ckpt-00000020.pt" and state["step"] == 20
    assert torch.equal(state["model"]["w"], _state(20)["model"]["w"])


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_debris(tmp_path, monkeypatch):
    checkpoint.save(_state(1), tmp_path, 1)
    real_save = torch.save

    def dies_halfway(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError):
        checkpoint.save(_state(2), tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]
    assert checkpoint.load_latest(tmp_path)[0]["step"] == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_newest_falls_back_to_previous_with_a_warning(tmp_path, damage):
    for step in (3, 6):
        checkpoint.save(_state(step), tmp_path, step)
    newest = tmp_path / "ckpt-00000006.pt"
    data = newest.read_bytes()
    newest.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00" * 999,
                        "empty": b""}[damage])
    warnings: list[str] = []
    state, path = checkpoint.load_latest(tmp_path, warn=warnings.append)
    assert path.name == "ckpt-00000003.pt" and state["step"] == 3
    assert len(warnings) == 1 and "ckpt-00000006.pt" in warnings[0]
    assert "falling back" in warnings[0]
    with pytest.warns(RuntimeWarning, match="ckpt-00000006.pt is unreadable"):
        checkpoint.load_latest(tmp_path)


class NotAllowed:
    pass


def test_loading_refuses_arbitrary_objects(tmp_path):
    state = _state(1)
    state["extra"] = NotAllowed()
    torch.save(state, tmp_path / "ckpt-00000001.pt")
    with pytest.raises(MicroDDPError) as refused:
        checkpoint.load(tmp_path / "ckpt-00000001.pt")
    # Our reason, not torch's advice to load with weights_only=False (which would run it).
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'ckpt-00000001.pt'} is unreadable (it holds a Python object "
        "(test_checkpoint.NotAllowed) that a safe load will not create; microddp saves only "
        "tensors and plain data, so the file is not its own or was altered)")
    torch.save({"step": 1}, tmp_path / "ckpt-00000002.pt")
    with pytest.raises(MicroDDPError, match="incomplete.*model"):
        checkpoint.load(tmp_path / "ckpt-00000002.pt")
    said: list[str] = []
    assert checkpoint.load_latest(tmp_path, warn=said.append) is None
    assert said[0].endswith("; falling back to the previous checkpoint")
    assert "falling back" not in said[1] and "scratch" not in said[1]  # the caller decides


def test_the_file_just_written_is_never_pruned(tmp_path):
    """Newer-numbered leftovers (of an old run, unreadable) must not cost the new checkpoint."""
    for step in (10, 20, 30):
        (tmp_path / f"ckpt-{step:08d}.pt").write_bytes(b"\x00" * 99)
    path = checkpoint.save(_state(5), tmp_path, 5, keep=3)
    assert checkpoint.load(path)["step"] == 5
    moved = checkpoint.set_aside(checkpoint.list_checkpoints(tmp_path)[1:])
    assert [p.name for p in moved] == ["ckpt-00000010.pt.unreadable",
                                       "ckpt-00000020.pt.unreadable",
                                       "ckpt-00000030.pt.unreadable"]
    assert checkpoint.list_checkpoints(tmp_path) == [path]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoints_get_the_permissions_the_umask_allows(tmp_path, umask):
    before = os.umask(umask)
    try:
        path = checkpoint.save(_state(1), tmp_path, 1)
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def _draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(),
            random.gauss(0, 1))


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in the Python state
    state = checkpoint.rng_state()
    expected = _draws()
    torch.save({"rng": state}, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)["rng"]
    _draws()
    checkpoint.set_rng_state(loaded)
    assert _draws() == expected


def _save_worker(world, folder):
    torch.manual_seed(100 + world.rank)
    mine = torch.get_rng_state()
    path = checkpoint.save_from_rank0(lambda: _state(7) | {"world_size": world.world_size},
                                      folder, 7, world)
    # After the barrier the file is complete on every rank.
    state = checkpoint.load(path)
    return torch.equal(state["rng"][world.rank]["torch"], mine), len(state["rng"]), path.name


def test_save_from_rank0_gathers_every_ranks_rng_and_all_see_the_file(tmp_path):
    results = microddp.launch.spawn(_save_worker, 2, args=(str(tmp_path),), timeout=60)
    assert results == [(True, 2, "ckpt-00000007.pt")] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000007.pt"]


def test_save_needs_a_sane_keep(tmp_path):
    with pytest.raises(MicroDDPError, match="keep must be at least 1"):
        checkpoint.save(_state(1), tmp_path, 1, keep=0)


def _flip_tensor_bytes(path, value: float, count: int = 200) -> None:
    """Flip `count` bytes inside the stored data of a tensor filled with `value`: the zip's
    structure stays whole, so only a digest of the contents can notice."""
    data = bytearray(path.read_bytes())
    at = bytes(data).find(np.float32(value).tobytes() * 64)
    assert at > 0, "the tensor's bytes were not found in the file"
    for i in range(at, at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_tensor_are_refused_and_the_previous_checkpoint_used(tmp_path):
    """torch's reader loads a file whose tensor bytes changed on disk without a word; the
    digest saved with the contents turns that into 'damaged' and the fallback."""
    for step in (3, 6):
        state = _state(step)
        state["model"] = {"w": torch.full((1000,), 1.2345)}
        checkpoint.save(state, tmp_path, step)
    newest = tmp_path / "ckpt-00000006.pt"
    _flip_tensor_bytes(newest, 1.2345)
    loaded = torch.load(newest, weights_only=True)  # what a plain load would resume from
    assert not torch.equal(loaded["model"]["w"], torch.full((1000,), 1.2345))
    with pytest.raises(MicroDDPError, match=r"ckpt-00000006.pt is damaged \(its contents do "
                                            r"not match the digest"):
        checkpoint.load(newest)
    said: list[str] = []
    state, path = checkpoint.load_latest(tmp_path, warn=said.append)
    assert path.name == "ckpt-00000003.pt" and state["step"] == 3
    assert torch.equal(state["model"]["w"], torch.full((1000,), 1.2345))
    assert len(said) == 1 and "is damaged" in said[0] and "falling back" in said[0]


def test_a_damaged_shard_is_refused(tmp_path):
    from microddp.train import sharded

    path = tmp_path / "shard-00000.pt"
    checkpoint.write_atomic({"format": 1, "run": "r", "pieces": [
        {"name": "w", "start": 0, "param": torch.full((500,), -7.5), "state": {},
         "scalars": {}}]}, path)
    assert sharded._load(path, "cpu")["run"] == "r"
    _flip_tensor_bytes(path, -7.5)
    with pytest.raises(MicroDDPError, match="shard-00000.pt is damaged"):
        sharded._load(path, "cpu", mmap=True)


def test_the_digest_covers_every_kind_of_value_and_files_without_one_still_load(tmp_path):
    base = {"a": torch.arange(4), "b": [1, 2.5, "x", None, (True,)], "c": {"d": torch.zeros(0)}}
    d = checkpoint.digest(base)
    for changed in ({**base, "a": torch.arange(4).float()}, {**base, "b": [1, 2.5, "x", None,
                                                                          (False,)]},
                    {**base, "c": {"d": torch.zeros(0, 2)}}, {**base, "e": 0}):
        assert checkpoint.digest(changed) != d
    state = _state(1)
    torch.save(state, tmp_path / "ckpt-00000001.pt")  # an older microddp's file: no digest
    assert checkpoint.load(tmp_path / "ckpt-00000001.pt")["step"] == 1
