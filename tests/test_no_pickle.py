"""Nothing another process sends becomes a Python object by unpickling (issue 51).

A malicious pickle (one that creates a marker file when unpickled) is planted in every place bytes
from another process arrive: each of microddp's exchanges between ranks, checkpoint files and
shards, and store values. Each refuses it and the marker never appears; torch's own
`all_gather_object` and `torch.load(weights_only=False)` on the same bytes do create it, which
is what each test would see if the place still unpickled. A scan of the sources keeps new
places from appearing.
"""

import ast
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import MicroDDPError, checkpoint
from microddp.transport import objects

SRC = Path(__file__).resolve().parents[1] / "src" / "microddp"


class Evil:
    """Unpickling this touches `marker`: any code could run in its place."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _planted(marker: str):
    """An encode() that sends a malicious pickle instead of microddp's format."""
    return lambda value: pickle.dumps(Evil(marker))


def _places(world):
    """(name, the rank that plants, the call every rank makes) for each exchange between ranks."""
    from microddp.collectives import hierarchical
    from microddp.dp import sync
    from microddp.trace import report
    from microddp.train import loop, sharded

    class Strategy:
        def memory(self):
            return {"params": 1}

    return [
        ("trace.report.gather", 1, lambda: report.gather(None, world)),
        ("checkpoint.gather_rng_states", 1, lambda: checkpoint.gather_rng_states(world)),
        ("checkpoint.broadcast_choice", 0, lambda: checkpoint.broadcast_choice("x", world)),
        ("hierarchical.discover", 1, hierarchical.discover),
        ("dp.sync.verify_same_model", 1,
         lambda: sync.verify_same_model(torch.nn.Linear(2, 2))),
        ("train.loop._memory_per_rank", 1, lambda: loop._memory_per_rank(Strategy(), world)),
        ("train.sharded._gather", 1, lambda: sharded._gather("error", world)),
    ]


def _exchange_with_a_planted_pickle(world, marker: str) -> dict:
    honest = objects.encode
    out = {}
    for name, planter, call in _places(world):
        objects.encode = _planted(marker) if world.rank == planter else honest
        try:
            call()
            out[name] = "accepted"
        except MicroDDPError as e:
            out[name] = "refused" if "not in microddp's format" in str(e) else str(e)
        finally:
            objects.encode = honest
        out[name] += "" if not Path(marker).exists() else " and RAN"
    # the reference: torch's own call on the same payload
    got = [None] * world.world_size
    dist.all_gather_object(got, Evil(marker) if world.rank == 1 else None)
    out["torch all_gather_object"] = "ran" if Path(marker).exists() else "did not run"
    return out


def test_a_planted_pickle_is_refused_in_every_exchange_between_ranks(tmp_path):
    marker = str(tmp_path / "pwned")
    results = mdp.spawn(_exchange_with_a_planted_pickle, 2, args=(marker,), timeout=120)
    # who decodes what the planter sent: a gather's destination, else every rank
    receivers = {"trace.report.gather": [0], "checkpoint.gather_rng_states": [0]}
    for rank, got in enumerate(results):
        for name, verdict in got.items():
            if name == "torch all_gather_object":
                assert verdict == "ran"  # torch unpickles: the same bytes run code there
            elif rank in receivers.get(name, [0, 1]):
                assert verdict == "refused", (rank, name, verdict)
            else:
                assert verdict == "accepted", (rank, name, verdict)


def test_values_round_trip_exactly_through_the_format():
    value = {"a": [1, 2.5, None, True, "s"], "t": torch.arange(6, dtype=torch.int64).view(2, 3),
             "h": torch.tensor([0.1, -2.0], dtype=torch.float64),
             "e": torch.empty(0), "nested": [(1, 2), {"b": torch.tensor([True, False])}]}
    back = objects.decode(objects.encode(value))
    assert back["a"] == value["a"] and back["nested"][0] == [1, 2]
    for k in ("t", "h", "e"):
        assert torch.equal(back[k], value[k]) and back[k].dtype == value[k].dtype
    assert torch.equal(back["nested"][1]["b"], value["nested"][1]["b"])
    state = checkpoint.rng_state()  # what gather_rng_states sends: it must restore exactly
    checkpoint.set_rng_state(objects.decode(objects.encode(state)))
    drawn = (torch.rand(3), random.random())
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(3), drawn[0]) and random.random() == drawn[1]


def test_an_object_that_is_not_data_is_refused_on_the_sender():
    with pytest.raises(MicroDDPError, match="a Evil cannot be sent between ranks"):
        objects.encode({"x": Evil("/nonexistent")})


@pytest.mark.parametrize("how", ["checkpoint.load", "sharded._load"])
def test_a_planted_pickle_in_a_checkpoint_file_is_refused(tmp_path, how):
    from microddp.train import sharded

    marker = tmp_path / "pwned"
    path = tmp_path / "planted.pt"
    torch.save({"format": checkpoint.FORMAT, "model": Evil(str(marker))}, path)
    load = checkpoint.load if how == "checkpoint.load" else sharded._load
    with pytest.raises(MicroDDPError, match="unreadable"):
        load(path, "cpu")
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the reference: an unsafe load runs it
    assert marker.exists()


def test_a_planted_pickle_in_the_store_is_never_unpickled(tmp_path):
    from microddp.monitor.hang import Monitor

    marker = tmp_path / "pwned"
    store = dist.HashStore()
    mon = Monitor(store, 0, 2, timeout_s=60, debug=False, prefix="m/", answer_s=0.1)
    try:
        store.set(mon.key("status", 1), pickle.dumps(Evil(str(marker))))
        with pytest.raises(ValueError):  # json.loads: not JSON, never code
            mon._statuses()
    finally:
        mon.close()
    assert not marker.exists()


# Calls that turn bytes from another process into objects by unpickling them.
UNPICKLING = {"all_gather_object", "gather_object", "broadcast_object_list",
              "scatter_object_list", "send_object_list", "recv_object_list", "loads", "load",
              "Unpickler"}
# spawn's results come back through multiprocessing's pipe from the children it started
# itself (same user, no network): the one use left, and why.
ALLOWED = {("launch/spawn.py", "loads")}


def test_no_module_unpickles_what_another_process_sent():
    found = []
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, owner = node.func.attr, ast.unparse(node.func.value)
            if name == "load" and owner == "torch":
                safe = any(k.arg == "weights_only" and ast.unparse(k.value) == "True"
                           for k in node.keywords)
                if not safe:
                    found.append((rel, "torch.load without weights_only=True"))
            elif name in UNPICKLING and (owner in ("pickle", "dist", "marshal")
                                         or name.endswith("_object")
                                         or name.endswith("_object_list")):
                if (rel, name) not in ALLOWED:
                    found.append((rel, f"{owner}.{name}"))
    assert found == [], found
