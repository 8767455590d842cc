"""The training loop: equal to single-process training, accumulation, exact resume, precision."""

import json
import shutil

import pytest
import torch

import microddp
from microddp.errors import MicroDDPError
from microddp.train import loop
from microddp.train.build import Precision
from microddp.train.config import TrainConfig
from microddp.train.strategies import dp as dp_strategy
from microddp.train.validate import validate

SMALL = {"dataset": "digits", "hidden": 32, "depth": 1, "plot": False}


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, "out": str(out), **kw})


def _worker(world, out, kw, count_no_sync=False):
    entered = []
    if count_no_sync:  # prove the loop skips synchronisation on N-1 micro-steps
        real_wrap = dp_strategy.wrap

        def counting_wrap(*a, **k):
            model = real_wrap(*a, **k)
            real = model.no_sync

            def no_sync():
                entered.append(1)
                return real()

            model.no_sync = no_sync
            return model

        dp_strategy.wrap = counting_wrap
    res = loop.train(world, _cfg(out, **kw))
    return {"params": res.params, "step": res.step, "acc": res.test_accuracy,
            "resumed_from": res.resumed_from, "no_sync": len(entered)}


def _spawn(n, out, count_no_sync=False, **kw):
    return microddp.launch.spawn(_worker, n, args=(str(out), kw, count_no_sync), timeout=120)


def _single(out, **kw):
    return _worker(microddp.init(), str(out), kw)


def _assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max())


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """Plain one-process training: 6 steps of batch 32 (what every engine must reproduce)."""
    r = _single(tmp_path_factory.mktemp("single"), batch_size=32, max_steps=6)
    microddp.shutdown()
    return r


@pytest.mark.parametrize("engine", ["microddp", "naive", "hooks", "buckets", "overlap", "torch"])
def test_every_engine_matches_single_process_training(tmp_path, single_run, engine):
    ranks = _spawn(2, tmp_path, batch_size=32, max_steps=6, engine=engine)
    assert [r["step"] for r in ranks] == [6, 6]
    assert ranks[0]["acc"] == ranks[1]["acc"]
    _assert_close(ranks[0]["params"], single_run["params"], atol=2e-6)
    assert ranks[0]["params"].keys() == single_run["params"].keys()


def test_accumulate_equals_n_times_larger_batch(tmp_path):
    # A full epoch: 1438 samples = 44 windows of 32 plus an uneven last window of 30.
    acc = _spawn(2, tmp_path / "acc", batch_size=16, accumulate=2, epochs=1, count_no_sync=True)
    big = _single(tmp_path / "big", batch_size=32, epochs=1)
    assert acc[0]["step"] == big["step"] == 45
    assert acc[0]["no_sync"] == 45  # one skipped synchronisation in every 2-micro-step window
    _assert_close(acc[0]["params"], big["params"], atol=2e-6)


def test_uneven_last_batch_over_three_ranks_matches_single_process(tmp_path):
    # 1438 = 29 x 48 + 46: the last step's 46 samples split 16 + 15 + 15 over the ranks.
    three = _spawn(3, tmp_path / "three", batch_size=48, epochs=1)
    one = _single(tmp_path / "one", batch_size=48, epochs=1)
    assert three[0]["step"] == one["step"] == 30
    _assert_close(three[0]["params"], one["params"], atol=2e-6)


def test_empty_shards_on_the_last_step_still_match_single_process(tmp_path):
    # 1438 = 1437 + 1: the last step's one sample leaves two of three ranks an empty batch.
    three = _spawn(3, tmp_path / "three", batch_size=1437, epochs=1)
    one = _single(tmp_path / "one", batch_size=1437, epochs=1)
    assert three[0]["step"] == one["step"] == 2
    _assert_close(three[0]["params"], one["params"], atol=2e-6)


def _metric_steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "step"]


@pytest.mark.slow  # whole jobs, stopped, corrupted and resumed
def test_resume_is_bit_identical_even_past_a_corrupt_checkpoint(tmp_path, capfd):
    run = {"batch_size": 64, "epochs": 2}  # 23 steps per epoch
    ref = _spawn(2, tmp_path / "ref", **run)[0]
    cut = tmp_path / "cut"
    first = _spawn(2, cut, **run, max_steps=30, checkpoint_every=10)[0]
    assert first["step"] == 30
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == ["ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000030.pt"]
    shutil.copytree(cut, tmp_path / "damaged")
    shutil.copytree(cut, tmp_path / "shrunk")

    resumed = _spawn(2, cut, **run, resume=True)[0]
    assert resumed["resumed_from"].endswith("ckpt-00000030.pt") and resumed["step"] == 46
    _assert_equal(resumed["params"], ref["params"])
    steps = _metric_steps(cut)
    assert steps == sorted(set(steps)) and steps[-1] == 46  # no step logged twice

    newest = tmp_path / "damaged" / "checkpoints" / "ckpt-00000030.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    capfd.readouterr()
    again = _spawn(2, tmp_path / "damaged", **run, resume=True)[0]
    assert "ckpt-00000030.pt is unreadable" in capfd.readouterr().err
    assert again["resumed_from"].endswith("ckpt-00000020.pt")
    _assert_equal(again["params"], ref["params"])

    # Another world size: the same samples per step, summed in another order.
    one = _single(tmp_path / "shrunk", **run, resume=True)
    assert "saved by 2 ranks, now 1" in capfd.readouterr().out
    _assert_close(one["params"], ref["params"], atol=1e-5)


def _deterministic_rows(out):
    """metrics.jsonl without what the clock decides (time, samples/s)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "samples_per_s")} for r in rows]


@pytest.mark.slow  # a whole job, stopped and resumed, against an uninterrupted one
def test_metrics_after_a_mid_epoch_resume_equal_an_uninterrupted_run(tmp_path):
    run = {"batch_size": 64, "epochs": 1}  # 23 steps, a progress line every 4 and at the end
    ref = _spawn(2, tmp_path / "ref", **run)[0]
    cut = tmp_path / "cut"
    _spawn(2, cut, **run, max_steps=7)  # stops between the lines of steps 4 and 8
    shutil.copytree(cut, tmp_path / "old")
    _spawn(2, cut, **run, resume=True)
    want = _deterministic_rows(tmp_path / "ref")
    assert [r["step"] for r in want if r["kind"] == "step"] == [4, 8, 12, 16, 20, 23]
    # Step 8's loss averages steps 5-8, although 5-7 ran before the resume.
    assert _deterministic_rows(cut) == want

    # A checkpoint from before the meter was saved still resumes, to the same weights.
    path = tmp_path / "old" / "checkpoints" / "ckpt-00000007.pt"
    state = torch.load(path, weights_only=True)
    del state["interval_loss"]
    del state["digest"]  # a file from before the meter was from before digests too
    torch.save(state, path)
    old = _spawn(2, tmp_path / "old", **run, resume=True)[0]
    _assert_equal(old["params"], ref["params"])
    assert _deterministic_rows(tmp_path / "old")[-1] == want[-1]


def test_world_size_that_cannot_split_the_batch_is_a_clear_error(tmp_path):
    with pytest.raises(MicroDDPError, match="--batch-size 64 .* split evenly over 3 ranks"):
        validate(_cfg(tmp_path, batch_size=64, resume=True), world_size=3)


@pytest.mark.slow  # a whole job, then resumes with other settings
def test_resume_with_other_settings_is_refused(tmp_path):
    _spawn(2, tmp_path, batch_size=32, max_steps=2)
    with pytest.raises(MicroDDPError, match=r"--batch-size 32 \(now 64\)"):
        _spawn(2, tmp_path, batch_size=64, resume=True)


def test_bf16_autocast_trains_close_to_float32(tmp_path, single_run):
    with Precision("bf16", torch.device("cpu")).autocast():
        out = torch.nn.Linear(4, 3)(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16
    bf16 = _spawn(2, tmp_path, batch_size=32, max_steps=6, amp="bf16")[0]["params"]
    diffs = [(bf16[k] - single_run["params"][k]).abs().max().item() for k in bf16]
    assert 0 < max(diffs) < 2e-2  # rounded differently, yet the same training


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only refusal")
def test_fp16_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(MicroDDPError, match="--amp fp16 needs a CUDA GPU.*--amp bf16"):
        validate(_cfg(tmp_path, amp="fp16"))
    with pytest.raises(MicroDDPError, match="needs a CUDA GPU"):
        Precision("fp16", torch.device("cpu"))


def test_hang_monitor_and_drift_check_leave_training_unchanged(tmp_path):
    """The monitor (on by default) and a drift check every step observe without touching the
    numbers: same parameters as with both off."""
    watched = _spawn(2, tmp_path / "on", batch_size=32, max_steps=4, drift_every=1)
    bare = _spawn(2, tmp_path / "off", batch_size=32, max_steps=4, monitor_timeout=0)
    _assert_equal(watched[0]["params"], bare[0]["params"])
    _assert_equal(watched[1]["params"], bare[0]["params"])


def _monitor_during_training(world, out, timeout):
    seen = []
    loop.train(world, _cfg(out, monitor_timeout=timeout, max_steps=2),
               on_step=lambda step: seen.append(microddp.monitor.active() is not None))
    return seen


@pytest.mark.parametrize("timeout, on", [(0.0, False), (60.0, True)])
def test_monitor_timeout_zero_turns_the_monitor_off(tmp_path, timeout, on):
    """--monitor-timeout 0 means no hang monitor, even though init() starts one by default."""
    for seen in microddp.launch.spawn(_monitor_during_training, 2,
                                      args=(str(tmp_path), timeout), timeout=120):
        assert seen == [on, on]


def test_a_nan_loss_stops_every_rank_naming_the_steps(tmp_path):
    """`--lr 1e30` made the loss nan from step 2 and the job went on to exit 0 (issue 57):
    the summed loss of a progress line is the same on every rank, so all stop there."""
    with pytest.raises(MicroDDPError, match=r"the training loss became nan in steps 1-2 "
                                            r"\(every rank stops here"):
        _single(tmp_path, lr=1e30, batch_size=32, max_steps=6, log_every=2)
    microddp.shutdown()


def _nan_worker(world, out):
    try:
        loop.train(world, _cfg(out, lr=1e30, batch_size=32, max_steps=6, log_every=2))
    except MicroDDPError as e:
        return str(e)
    return "trained on"


def test_a_nan_loss_stops_both_ranks_at_the_same_step(tmp_path):
    said = microddp.launch.spawn(_nan_worker, 2, args=(str(tmp_path),), timeout=120)
    assert said[0] == said[1] and "loss became nan in steps 1-2" in said[0]


def test_a_batch_larger_than_the_data_is_refused(tmp_path):
    """--batch-size 1e8 and --accumulate 1e5 printed batch sizes that were never used."""
    for kw, said in (({"batch_size": 1440}, "--batch-size 1440 is more than the 1438"),
                     ({"batch_size": 64, "accumulate": 23}, "--batch-size 64 x --accumulate 23")):
        with pytest.raises(MicroDDPError, match=said):
            _single(tmp_path, **kw)
        microddp.shutdown()
    assert _single(tmp_path / "fits", batch_size=1438, max_steps=1)["step"] == 1
