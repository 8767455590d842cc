"""`microddp train --strategy ...`: every strategy trains to one process's parameters, ZeRO's
sharded checkpoints resume on another world size, model.pt is the whole model, the final
metrics record carries what each rank measured, and bad input is one line and exit 2.

Tolerances. Every strategy computes the same sums as one process, in another order: a
rank's slice, a micro-batch, a reduce-scatter add the same terms grouped differently, so
float32 results differ by rounding (~1e-7 relative per operation). Over 6 SGD steps, which
move the weights by up to 0.036, the strategies below land within 2e-8 of one process
(measured); the bound is 2e-6, the one test_train.py holds the data-parallel engines to.
Adam divides by the root of a running square of the gradient, so an element whose gradient
is near zero turns a rounding difference into a step-sized one: measured up to 3e-7 over 6
steps (weights move up to 0.012); the bound is 2e-5.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import microddp
from cli_examples import command_lines, run_command
from microddp import checkpoint
from microddp.commands import main
from microddp.commands.train import EPILOG
from microddp.comms.mesh import Mesh
from microddp.errors import MicroDDPError
from microddp.monitor.log import main_thread_where, note
from microddp.pipeline import Action
from microddp.train import loop, resume
from microddp.train.config import TrainConfig

# Depth 4: two stages of two blocks, or 2 ranks x 2 virtual stages (interleaved).
SMALL = {"dataset": "digits", "hidden": 32, "depth": 4, "plot": False, "batch_size": 48,
         "max_steps": 6}
SGD_TOL, ADAM_TOL = 2e-6, 2e-5


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, "out": str(out), **kw})


def _worker(world, out, kw):
    res = loop.train(world, _cfg(out, **kw))
    return {"params": res.params, "step": res.step, "acc": res.test_accuracy,
            "resumed_from": res.resumed_from}


def _spawn(n, out, **kw):
    return microddp.launch.spawn(_worker, n, args=(str(out), kw), timeout=180)


def _single(out, **kw):
    return microddp.launch.spawn(_worker, 1, args=(str(out), kw), timeout=180)[0]


def _assert_close(a, b, atol):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


def _final(out) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "final"
    return rows[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, SGD and Adam: what every strategy must reproduce."""
    root = tmp_path_factory.mktemp("one")
    return {opt: _single(root / opt, optimizer=opt) for opt in ("sgd", "adam")}


CASES = [
    # (strategy, ranks, extra settings)
    ("zero1", 2, {}),
    ("zero2", 2, {"optimizer": "adam"}),
    ("zero3", 3, {}),
    ("zero3", 2, {"optimizer": "adam", "accumulate": 2, "batch_size": 24}),
    ("pp", 2, {"schedule": "gpipe", "microbatches": 4}),
    ("pp", 2, {"schedule": "1f1b", "microbatches": 5}),  # 48 samples: 10, 10, 10, 9, 9
    ("pp", 2, {"schedule": "interleaved", "optimizer": "adam"}),
    ("pp", 2, {"schedule": "zero-bubble", "microbatches": 3}),
    ("dp-pp", 4, {"pp": 2, "schedule": "1f1b", "microbatches": 2}),
]


@pytest.mark.parametrize("strategy, n, extra", CASES,
                         ids=[f"{s}-{n}-{'-'.join(map(str, e.values()))}" for s, n, e in CASES])
def test_every_strategy_matches_one_process(tmp_path, reference, strategy, n, extra):
    ranks = _spawn(n, tmp_path, strategy=strategy, **extra)
    assert [r["step"] for r in ranks] == [6] * n
    assert len({r["acc"] for r in ranks}) == 1  # one evaluation, the same on every rank
    ref = reference[extra.get("optimizer", "sgd")]
    # --accumulate 2 of 24 is the same 48 samples per step as the reference's batch of 48
    _assert_close(ranks[0]["params"], ref["params"],
                  ADAM_TOL if extra.get("optimizer") == "adam" else SGD_TOL)
    # model.pt is the whole model (gathered from stages or shards), as one process writes it
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved.keys() == ref["params"].keys()
    for k in saved:
        assert torch.equal(saved[k], ranks[0]["params"][k])


@pytest.mark.slow  # whole bf16 jobs per stage (tests/test_zero_exact.py proves the stages in the default set)
def test_zero_bf16_equals_dp_bf16(tmp_path):
    """Under autocast both compute each slice's forward in bfloat16 the same way; only the
    averaging differs (a reduce-scatter against an all-reduce)."""
    dp = _spawn(2, tmp_path / "dp", amp="bf16")[0]
    z = _spawn(2, tmp_path / "z", amp="bf16", strategy="zero2")[0]
    _assert_close(z["params"], dp["params"], SGD_TOL)


@pytest.mark.parametrize("strategy, optimizer, then, extra", [
    ("zero2", "adam", 3, {}), ("zero3", "sgd", 3, {}),
    ("dp-pp", "adam", 4, {"pp": 2}),  # one pipeline of 2 stages, then 2 replicas of it
])
@pytest.mark.slow  # whole jobs saved at one world size and resumed at another
def test_sharded_checkpoint_resumes_on_another_world_size(tmp_path, reference, strategy,
                                                          optimizer, then, extra):
    """Saved by 2 ranks at step 3, resumed by more (re-sharded): the same weights after 6
    steps as one process that never stopped."""
    out = tmp_path / "run"
    first = _spawn(2, out, strategy=strategy, optimizer=optimizer, max_steps=3,
                   checkpoint_every=3, **extra)
    assert first[0]["step"] == 3
    ckpt = out / "checkpoints" / "ckpt-00000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert sorted(manifest["files"]) == ["common.pt", "shard-00000.pt", "shard-00001.pt"]
    again = _spawn(then, out, strategy=strategy, optimizer=optimizer, resume=True, **extra)
    assert again[0]["resumed_from"] == str(ckpt) and again[0]["step"] == 6
    _assert_close(again[0]["params"], reference[optimizer]["params"],
                  ADAM_TOL if optimizer == "adam" else SGD_TOL)


@pytest.mark.slow  # a whole job per strategy for its final record (tests/test_zero_memory.py measures the memory in the default set)
def test_final_record_carries_accuracy_speed_and_measured_memory(tmp_path):
    rows = {}
    for strategy in ("dp", "zero1", "zero3"):
        _spawn(2, tmp_path / strategy, strategy=strategy, optimizer="adam")
        rows[strategy] = final = _final(tmp_path / strategy)
        assert 0 < final["test_accuracy"] <= 1 and final["samples_per_s"] > 0
        assert [m["rank"] for m in final["memory"]] == [0, 1]
        for m in final["memory"]:
            assert set(m) == {"rank", "params", "grads", "optimizer_state", "sent_per_step"}
    dp, z1, z3 = (rows[s]["memory"] for s in ("dp", "zero1", "zero3"))
    params = sum(p.numel() * 4 for p in microddp.FullMLP(32, 4, 10, 64).parameters())
    assert dp[0]["params"] == dp[0]["grads"] == params  # a whole replica, float32
    assert dp[0]["optimizer_state"] > 2 * params  # Adam: two moments (and its step counts)
    # ZeRO-1 splits Adam's moments over the ranks, to within the padding of one element
    moments = [m["optimizer_state"] for m in z1]
    assert abs(sum(moments) - dp[0]["optimizer_state"]) <= 64 and max(moments) < 0.6 * dp[0][
        "optimizer_state"]
    # ZeRO-3 keeps only its shard of the parameters between uses
    assert all(m["params"] < 0.6 * params for m in z3)
    assert all(m["sent_per_step"] > 0 for m in dp + z1 + z3)


def test_mesh_lays_out_pipelines_and_replicas():
    mesh = Mesh(dp=2, pp=3)
    assert [mesh.pp_ranks(d) for d in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [mesh.dp_ranks(s) for s in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [mesh.coords(r) for r in (0, 4, 5)] == [(0, 0), (1, 1), (1, 2)]
    with pytest.raises(MicroDDPError, match="outside a mesh"):
        mesh.coords(6)
    with pytest.raises(MicroDDPError, match="pp >= 1"):
        Mesh(dp=2, pp=0)


def _zero_checkpoint(tmp_path, name):
    out = tmp_path / name
    _spawn(2, out, strategy="zero1", max_steps=2, checkpoint_every=2)
    return out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """Before any rank starts: the launcher checks the settings and the checkpoint."""
    monkeypatch.delenv("RANK", raising=False)
    missing, other = _zero_checkpoint(tmp_path, "missing"), _zero_checkpoint(tmp_path, "other")
    (missing / "checkpoints" / "ckpt-00000002" / "shard-00001.pt").unlink()
    mixed = tmp_path / "mixed"
    shutil.copytree(other, mixed)
    shutil.copy(missing / "checkpoints" / "ckpt-00000002" / "shard-00000.pt",
                mixed / "checkpoints" / "ckpt-00000002" / "shard-00000.pt")
    same = ["--batch-size", "48", "--hidden", "32", "--depth", "4"]  # as _zero_checkpoint's
    cases = [
        (["--strategy", "fsdp"], "unknown strategy 'fsdp'; choose one of dp, pp, dp-pp"),
        (["--strategy", "pp", "--schedule", "chimera"], "unknown pipeline schedule 'chimera'"),
        (["--strategy", "pp", "--nproc", "4", "--depth", "2"],
         "--pp 4 needs 4 stages, more than the model's 2 layers"),
        (["--strategy", "pp", "--schedule", "interleaved", "--depth", "3"],
         "needs 4 stages, more than the model's 3 layers"),
        (["--strategy", "pp", "--microbatches", "0"], "--microbatches must be at least 1"),
        (["--strategy", "dp-pp", "--nproc", "4", "--pp", "3", "--depth", "4"],
         "--pp 3 stages do not divide --nproc 4 ranks"),
        (["--strategy", "pp", "--pp", "1"], "--strategy pp puts one stage on every rank"),
        (["--pp", "2"], "--pp 2 cuts a pipeline, which --strategy dp has none of"),
        (["--strategy", "zero2", "--engine", "torch"], "replaces with ZeRO's own"),
        (["--strategy", "zero3", "--drift-every", "2"], "--drift-every compares whole replicas"),
        (["--strategy", "zero1", *same, "--resume", "--out", str(missing)],
         "is missing shard-00001.pt"),
        (["--strategy", "zero1", *same, "--resume", "--out", str(mixed)], "belongs to run"),
        (["--strategy", "zero2", *same, "--resume", "--out", str(other)],
         "was made with --strategy zero1 (now zero2);"),
    ]
    for args, message in cases:
        assert main(["train", *args]) == 2, args
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert out == "" and len(lines) == 1, (args, err)
        assert lines[0].startswith("microddp train: error: ") and message in lines[0], \
            (args, lines[0])


@pytest.mark.slow  # four whole training jobs as the help writes them (test_every_strategy_matches_one_process proves each strategy in the default set)
def test_strategy_examples_in_help_run_as_written(tmp_path):
    """The --strategy lines of `microddp train --help` train to a useful model, as written.
    (The async lines run minutes of straggling workers: tests/test_train_async.py trains their
    configurations on a small budget, and test_cli_help parses them.)"""
    lines = [line for line in command_lines(EPILOG)
             if "--strategy" in line and "--strategy async" not in line]
    assert {line.split("--strategy ")[1].split()[0] for line in lines} == {
        "zero2", "zero3", "pp", "dp-pp"}
    accuracy = {}
    for line in lines:
        done = run_command(line, tmp_path)
        accuracy[line] = float(done.stdout.split("done: test accuracy ")[1].split("%")[0])
    assert all(a > 50 for a in accuracy.values()), accuracy  # ten classes: chance is 10%


class _BarrierFirst(torch.nn.Module):
    """A stage whose forward waits in a barrier first: its rank never sends anything."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        microddp.comms.barrier()
        return self.inner(x)


def _stuck_pipeline(world):
    """Both ranks start a pipeline step (its agreement passes); rank 0's first forward then
    waits in a barrier, so rank 1 waits for an activation that never comes."""
    microddp.monitor.enable(timeout=2.0, interrupt=True)  # the barrier raises the report
    torch.manual_seed(0)
    stages = microddp.pipeline.split_model(microddp.FullMLP(4, 2), 2)
    schedule = microddp.pipeline.build("1f1b", 2, 2)
    x, y = torch.randn(4, 4), torch.zeros(4, dtype=torch.long)
    mine = {0: _BarrierFirst(stages[0])} if world.rank == 0 else {1: stages[1]}
    microddp.pipeline.run_schedule(schedule, mine, x, y, torch.nn.functional.cross_entropy)


def test_a_stuck_pipeline_rank_is_named_with_its_schedule_action():
    with pytest.raises(MicroDDPError) as info:
        microddp.launch.spawn(_stuck_pipeline, 2, timeout=60)
    assert "rank 1 is in recv at runtime.py:" in str(info.value)
    assert "during RECV_ACT(stage 1, micro-batch 0)" in str(info.value)


def test_a_hang_report_names_the_pipeline_action_a_rank_waits_in():
    seen = []
    note(Action(rank=1, kind="RECV_ACT", mb=2, stage=1))
    try:
        reader = threading.Thread(target=lambda: seen.append(main_thread_where()))
        reader.start()
        reader.join()
    finally:
        note(None)
    assert seen[0].endswith("during RECV_ACT(stage 1, micro-batch 2)"), seen
    assert "during" not in main_thread_where()


@pytest.mark.slow  # a job, a killed rank and a restart: a stress test, for CI's slow run
@pytest.mark.parametrize("strategy", ["zero3", "pp"])
def test_a_sharded_job_survives_a_killed_rank(tmp_path, strategy):
    """--max-restarts: the restarted ranks resume from the last sharded checkpoint and end
    with the very weights of a run that was never interrupted."""
    args = ["--strategy", strategy, "--depth", "4", "--epochs", "2", "--batch-size", "48"]
    train = [sys.executable, "-m", "microddp", "train", *args]
    ref = subprocess.run([*train, "--out", str(tmp_path / "ref")], capture_output=True,
                         text=True, timeout=240)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    out = tmp_path / "crash"
    job = subprocess.Popen([*train, "--out", str(out), "--max-restarts", "1",
                            "--checkpoint-every", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 180
        while killed is None and time.monotonic() < deadline and job.poll() is None:
            if any((p / "manifest.json").exists()
                   for p in checkpoint.list_checkpoints(out / "checkpoints")):
                for child in psutil.Process(job.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == "1":
                            killed = child.pid
                            os.kill(killed, signal.SIGKILL)
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
            time.sleep(0.01)
        log, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert killed is not None and job.returncode == 0, log
    assert "restarting all 2 workers (restart 1 of 1)" in log and "resuming from ckpt-" in log
    a = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _consolidate(world):
    torch.manual_seed(0)
    z = microddp.zero.Zero(microddp.FullMLP(8, 3), torch.optim.SGD, stage=3, lr=0.1)
    whole = z.full_state_dict()  # every rank gathers everything: the reference
    mine = z.consolidated_state_dict(to_rank=0)
    held = z.measure_now()["params"]  # after: only this rank's shard is alive
    return whole, mine, held, sum(s.numel() * 4 for s in z.shards.params)


def test_zero3_model_pt_goes_to_rank_0_only_and_leaves_only_shards_behind():
    ranks = microddp.launch.spawn(_consolidate, 2, timeout=120)
    (whole, on_0, held_0, shard_0), (_, on_1, held_1, shard_1) = ranks
    assert on_1 is None and on_0.keys() == whole.keys()
    assert all(torch.equal(on_0[k], whole[k]) for k in whole)
    assert (held_0, held_1) == (shard_0, shard_1)  # no layer left gathered on any rank


def test_an_interrupted_sharded_save_is_skipped_for_the_one_before(tmp_path):
    """A ckpt-N folder without its manifest (the save was cut short) is not resumed from."""
    out = _zero_checkpoint(tmp_path, "run")
    folder = out / "checkpoints"
    shutil.copytree(folder / "ckpt-00000002", folder / "ckpt-00000004")
    (folder / "ckpt-00000004" / "manifest.json").unlink()
    said: list[str] = []
    cfg = _cfg(out, strategy="zero1", resume=True)
    path, error = resume.decide(cfg, warn=said.append)
    assert error is None and path == str(folder / "ckpt-00000002")
    assert len(said) == 1 and "ckpt-00000004 is incomplete (no manifest.json" in said[0]
