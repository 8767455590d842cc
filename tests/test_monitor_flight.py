"""Flight Recorder dumps on a hang, read by torch's own analyser (torchfrtrace).

Each case plants a desync on real ranks; the monitor's report makes every rank that can answer
write its dump into the run folder; then torch's fr_trace (the `torchfrtrace` command) reads
the folder and must name the collective and the rank, as microddp's report does.
"""

import os
import pickle
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import monitor
from microddp.monitor import flight

STALL_S = 1.5


def _wait_for_dump(deadline_s: float = 20.0) -> list[str]:
    mon = monitor.active()
    end = time.monotonic() + deadline_s
    while not mon.dumped and time.monotonic() < end:
        time.sleep(0.05)
    return [str(p) for p in mon.dumped]


def _planted(world, case, folder):
    flight.set_run_dir(folder)
    monitor.enable(timeout=STALL_S)
    t = torch.ones(4)
    if case == "never" and world.rank == 1:
        return None, _wait_for_dump(), None  # rank 1 never reaches its first collective
    error, torch_own = None, None
    try:
        dist.all_reduce(t)
        torch_own = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())  # torch's gloo dump
        if case == "gone" and world.rank == 1:
            return None, [], None  # leaves the job before the second collective: no dump
        if case == "skip" and world.rank == 1:
            pass  # rank 1 skips the second all-reduce
        elif case == "bcast" and world.rank == 1:
            dist.broadcast(t, src=0)  # LINE-BCAST
        else:
            dist.all_reduce(t)  # LINE-ALLREDUCE
    except mdp.MicroDDPError as e:
        error = str(e)
    return error, _wait_for_dump(), torch_own


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if f"# {marker}" in line)


def _frtrace(folder, *flags) -> str:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          *flags, str(folder)], capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def _spawn(case, n, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # torch's own recorder too, to compare
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    return mdp.spawn(_planted, n, args=(case, str(tmp_path)), timeout=90)


def test_skipped_all_reduce_named_by_torchfrtrace(tmp_path, monkeypatch):
    res = _spawn("skip", 2, tmp_path, monkeypatch)
    folder = tmp_path / flight.FOLDER
    assert sorted(os.listdir(folder)) == ["fr_trace_rank_0", "fr_trace_rank_1"]
    assert f"Flight Recorder dumps in {folder}" in res[0][0]
    text = _frtrace(folder)
    assert "Not all ranks joining collective, sequence number: 2" in text
    assert "collective: gloo:all_reduce" in text
    assert "missing ranks: {1}" in text
    assert f"test_monitor_flight.py:{_line('LINE-ALLREDUCE')}" in text
    # the same file format as torch's own recorder (every field it writes), with more in it
    ours = pickle.loads((folder / "fr_trace_rank_0").read_bytes())
    theirs = res[0][2]
    assert set(theirs) - {"comm_lib_version"} <= set(ours)
    assert ours["version"] == theirs["version"]
    assert set(theirs["entries"][0]) <= set(ours["entries"][0])
    first, stuck = ours["entries"]
    assert (first["state"], stuck["state"]) == ("completed", "started")
    assert first["duration_ms"] > 0 and stuck["duration_ms"] is None
    assert first["collective_seq_id"] == 1 and stuck["collective_seq_id"] == 2
    assert ours["pg_config"][first["process_group"][0]]["ranks"] == "[0, 1]"
    # torch's own gloo recorder leaves every entry "scheduled", without a duration
    assert {e["state"] for e in theirs["entries"]} == {"scheduled"}


def _odd_rank(text: str) -> int:
    """The rank whose collective differs, as torchfrtrace's output says it: it compares every
    rank with the first dump it read (directory order) and calls the others culprits, so the
    odd rank is the one culprit, or the first rank itself when all the others are culprits."""
    culprits = {int(r) for r in re.findall(r"Culprit rank (\d+)", text)}
    expected = set(map(int, re.search(r"expected ranks: \{([\d, ]+)\}", text).group(1).split(",")))
    if len(culprits) == 1:
        return culprits.pop()
    (first,) = expected - culprits
    return first


@pytest.mark.slow
def test_broadcast_against_all_reduce_named_by_torchfrtrace(tmp_path, monkeypatch):
    res = _spawn("bcast", 3, tmp_path, monkeypatch)
    assert "rank 1 is in broadcast #2" in res[0][0]  # microddp's report
    text = _frtrace(tmp_path / flight.FOLDER)
    assert "Collective sequence number: 2 has errors" in text
    assert "COLLECTIVE_TYPE_MISMATCH" in text
    assert re.search(r"'(broadcast|all_reduce)' does not match found collective type: "
                     r"'(all_reduce|broadcast)'", text)
    assert _odd_rank(text) == 1


@pytest.mark.slow
def test_rank_that_never_arrives_named_by_torchfrtrace(tmp_path, monkeypatch):
    _spawn("never", 2, tmp_path, monkeypatch)
    text = _frtrace(tmp_path / flight.FOLDER)
    assert "Not all ranks joining collective, sequence number: 1" in text
    assert "collective: gloo:all_reduce" in text and "missing ranks: {1}" in text


@pytest.mark.slow
def test_rank_that_left_named_by_torchfrtrace(tmp_path, monkeypatch):
    _spawn("gone", 2, tmp_path, monkeypatch)
    folder = tmp_path / flight.FOLDER
    assert os.listdir(folder) == ["fr_trace_rank_0"]
    assert "Missing dump files from ranks {1}" in _frtrace(folder)
    # (its -j listing needs the tabulate package, which torch does not require)
    assert "missed FR dumps from ranks ({1})" in _frtrace(folder, "--allow-incomplete-ranks")
    dump = pickle.loads((folder / "fr_trace_rank_0").read_bytes())
    assert [(e["profiling_name"], e["state"]) for e in dump["entries"]] == [
        ("gloo:all_reduce", "completed"), ("gloo:all_reduce", "started")]


def test_sizes_follow_torchs_conventions():
    class E:  # the two fields _sizes reads
        def __init__(self, shape):
            self.shape = shape
    assert flight._sizes(E("float32[4,2]"), "all_reduce", 2) == ([[4, 2]], [[4, 2]], ["Float"])
    assert flight._sizes(E("float32[3]"), "all_gather", 4) == ([[3]], [[12]], ["Float"])
    assert flight._sizes(E("int64[3]"), "_reduce_scatter_base", 2) == ([[6]], [[3]], ["Long"])
    assert flight._sizes(E("2xfloat32[3]"), "broadcast", 2)[0] == [[3], [3]]
    assert flight._sizes(E(""), "barrier", 2) == ([[]], [[]], [])
    assert flight.kind("ring_all_reduce") == "all_reduce" and flight.kind("barrier") == "barrier"


def _on_a_subgroup(world, folder):
    flight.set_run_dir(folder)
    pair = dist.new_group([0, 1])
    monitor.enable(timeout=STALL_S)
    t = torch.ones(4)
    dist.all_reduce(t)
    error = None
    try:
        if world.rank == 0:
            dist.all_reduce(t, group=pair)  # rank 1 never joins it
    except mdp.MicroDDPError as e:
        error = str(e)
    return error, _wait_for_dump()


@pytest.mark.slow
def test_subgroup_members_and_missing_rank(tmp_path):
    res = mdp.spawn(_on_a_subgroup, 3, args=(str(tmp_path),), timeout=90)
    assert "rank 0 is in all_reduce #1 on group" in res[0][0]
    folder = tmp_path / flight.FOLDER
    dump = pickle.loads((folder / "fr_trace_rank_0").read_bytes())  # rank 2 lists only its own
    assert sorted(c["ranks"] for c in dump["pg_config"].values()) == ["[0, 1, 2]", "[0, 1]"]
    text = _frtrace(folder)
    assert "Not all ranks joining collective, sequence number: 1" in text
    assert "missing ranks: {1}" in text and "expected ranks: {0, 1}" in text
