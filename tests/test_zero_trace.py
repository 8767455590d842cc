"""ZeRO on the timeline: traced, every stage records its phases as DDP records its own (each
bucket's gradient reduce, the wait for them, the shard's step, the broadcast of the updated
elements; stage 3 each layer's gather, prefetch and free), tracing changes no number, and
nothing is recorded while tracing is off. `microddp train --strategy zero3 --trace` writes
them into trace.json with the overlap figures."""

import json

import torch

import microddp
from microddp import spans as trace
from microddp import zero
from microddp.model import FullMLP
from microddp.train import loop
from microddp.train.config import TrainConfig

STEPS, DIM, DEPTH = 3, 32, 3
CAP_MB = 0.005  # 1310 float32 elements: several buckets for stages 1 and 2


def _train(world, stage: int) -> tuple[zero.Zero, dict]:
    torch.manual_seed(0)
    model = zero.Zero(FullMLP(DIM, DEPTH), torch.optim.Adam, stage=stage,
                      bucket_cap_mb=CAP_MB, lr=1e-2)
    g = torch.Generator().manual_seed(1 + world.rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, DIM, generator=g), torch.randint(0, 2, (8,), generator=g)
        with trace.span("forward"):
            out = model(x)
        with trace.span("backward"):
            torch.nn.functional.cross_entropy(out, y).backward()
        model.step()
        model.zero_grad()
        trace.next_step()
    return model, {k: v.clone() for k, v in model.full_state_dict().items()}


def _job(world):
    out = {}
    for stage in zero.STAGES:
        _, plain = _train(world, stage)
        rec = trace.start()
        model, traced = _train(world, stage)
        trace.stop()
        off = trace.start()
        with trace.use(None):  # a recorder exists, but none is active: nothing may reach it
            _, untraced = _train(world, stage)
        trace.stop()
        out[stage] = {
            "same": all(torch.equal(plain[k], traced[k]) and torch.equal(plain[k], untraced[k])
                        for k in plain),
            "off": len(off.spans),
            "spans": [(s.name, s.track, s.step, s.start, s.end, s.args) for s in rec.spans],
            "buckets": len(model.plan.buckets),
            "bytes": 4 * sum(p.numel() for p in model.sharded),
            "units": ([(u.name, sum(4 * f.numel() for f in u.flats)) for u in model.sharder.units]
                      if model.sharder else []),
        }
    return out


def _names(spans, step, prefix):
    return [s for s in spans if s[2] == step and s[0].startswith(prefix)]


def test_every_stage_records_its_phases_and_tracing_changes_nothing():
    results = microddp.spawn(_job, 2, timeout=180)
    for res in results:
        for stage, r in res.items():
            assert r["same"], stage
            assert r["off"] == 0
            spans = r["spans"]
            assert all(s[3] <= s[4] for s in spans)
            for step in range(STEPS):
                window = [s for s in spans if s[2] == step and s[1] != "comm"]
                lo = min(s[3] for s in window)
                # every gradient byte went through exactly one traced reduce, bucket by bucket
                reduces = _names(spans, step, "reduce-scatter bucket ")
                assert all(s[1] == "comm" for s in reduces)
                assert sorted(s[5]["bucket"] for s in reduces) == list(range(r["buckets"]))
                assert sum(s[5]["bytes"] for s in reduces) == r["bytes"]
                assert all(s[3] >= lo for s in reduces)
                assert len(_names(spans, step, "wait comm")) == 1
                assert len(_names(spans, step, "shard step")) == 1
                gathers = _names(spans, step, "all-gather bucket ")
                if stage < 3:
                    assert r["buckets"] > 1
                    assert sorted(s[5]["bucket"] for s in gathers) == list(range(r["buckets"]))
                    assert sum(s[5]["bytes"] for s in gathers) == r["bytes"]
                    assert len(_names(spans, step, "wait params")) == 1
                    continue
                assert gathers == [] and _names(spans, step, "wait params") == []
                # stage 3: each layer gathered for its forward and again for its backward,
                # and freed after each; from the second step on all but the first layer of
                # each pass arrive by prefetch
                units = r["units"]
                assert len(units) == DEPTH + 1 and r["buckets"] == len(units)
                for name, nbytes in units:
                    got = [s for s in spans if s[2] == step and s[1] == "comm"
                           and s[0] in (f"gather {name}", f"prefetch {name}")]
                    assert len(got) == 2 and all(s[5]["bytes"] == nbytes for s in got)
                    assert len([s for s in _names(spans, step, "free")
                                if s[5]["module"] == name]) == 2
                prefetched = _names(spans, step, "prefetch ")
                assert len(prefetched) == (2 * (len(units) - 1) if step else len(units) - 1)


def _train_job(world, out):
    loop.train(world, TrainConfig(dataset="digits", hidden=32, depth=2, plot=False,
                                  batch_size=48, max_steps=4, strategy="zero3", trace=True,
                                  out=out))


def test_train_zero3_trace_writes_the_phases_and_the_overlap(tmp_path):
    microddp.spawn(_train_job, 2, args=(str(tmp_path),), timeout=180)
    doc = json.loads((tmp_path / "trace.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = {e["name"].split(" ")[0] for e in xs if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "shard", "reduce-scatter", "gather",
                "prefetch", "free", "wait"} <= names
        comm = {e["name"].split(" ")[0] for e in xs if e["pid"] == rank and e["tid"] == 1}
        assert comm == {"reduce-scatter", "gather", "prefetch"}
    assert (tmp_path / "timeline.png").stat().st_size > 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "trace_step"]
    assert len(steps) == 4
    assert all(r["comm_ms"] > 0 and 0 <= r["overlap_pct"] <= 100 for r in steps)
