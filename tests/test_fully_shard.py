"""fully_shard's behaviours, each against one process's training or a hand-worked number, on
2 and 3 ranks: the helpers' awkward model (sizes no world size divides, a frozen layer, a
zero-sized parameter FSDP2 cannot take, two parameter groups) trains to one process's
parameters with and without reshard_after_forward and with accumulation; between steps a rank
holds only its rows; .grad after backward is this rank's rows of the averaged gradient; a full
state dict saves and loads; clip_grad_norm_ clips by the whole gradient's norm; and what it
refuses, in one line."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import zero
from microddp.errors import MicroDDPError
from zero_helpers import OPTIMIZERS, STEPS, data, fresh, groups, local, loss_fn, max_diff, single


def shard_all(model, **kw):
    for layer in (model.a, model.b, model.c, model.frozen):
        zero.fully_shard(layer, **kw)
    return zero.fully_shard(model, **kw)


def train(world, name, micro=1, clip=None, **kw):
    model = shard_all(fresh(), **kw)
    cls, opts = OPTIMIZERS[name]
    opt = cls(groups(model), **opts)
    for step in range(STEPS):
        for k in range(micro):
            model.set_requires_gradient_sync(k == micro - 1)
            x, y = local(world, step, micro, k)
            (loss_fn(model(x), y) / micro).backward()
        if clip is not None:
            zero.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def single_clipped(name, clip):
    model = fresh()
    cls, kw = OPTIMIZERS[name]
    opt = cls(groups(model), **kw)
    for step in range(STEPS):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def full_params(model):
    full = model.full_state_dict()
    return [full[n] for n, _ in fresh().named_parameters()]


def cases(world):
    out = {}
    for name in OPTIMIZERS:
        out[name] = max_diff(full_params(train(world, name)), single(name))
    out["kept after forward"] = max_diff(
        full_params(train(world, "adam", reshard_after_forward=False)), single("adam"))
    out["accumulate x2"] = max_diff(full_params(train(world, "adam", micro=2)), single("adam"))
    out["clip"] = max_diff(full_params(train(world, "sgd", clip=0.05)),
                           single_clipped("sgd", 0.05))
    # between steps: only the shards; the rows are torch.chunk's
    model = train(world, "sgd")
    out["freed"] = [m._mdp_unit.flat.untyped_storage().nbytes() for m in model.modules()
                    if getattr(m, "_mdp_unit", None) is not None]
    out["rows"] = model.a.weight.shape[0], model.b.weight.shape[0], model.empty.shape
    # .grad after backward: this rank's rows of the averaged gradient (one process's)
    ref = fresh()
    x, y = data(0)
    loss_fn(ref(x), y).backward()
    model = shard_all(fresh())
    x, y = local(world, 0)
    loss_fn(model(x), y).backward()
    chunk = ref.a.weight.grad.chunk(world.world_size)[world.rank]
    out["grad rows"] = (model.a.weight.grad - chunk).abs().max().item()
    out["frozen grad"] = model.frozen.weight.grad
    # a full state dict saves and loads (into a model sharded afresh, after a step)
    trained = train(world, "adam")
    saved = trained.full_state_dict()
    other = shard_all(fresh())
    other.load_full_state_dict(saved)
    out["loaded"] = max_diff(list(other.full_state_dict().values()), list(saved.values()))
    out["loaded differs from fresh"] = max_diff(list(shard_all(fresh()).full_state_dict().values()),
                                                list(saved.values()))
    # eval without grad: the output equals one process's, and the parameters are freed again
    with torch.no_grad():
        got = other(data(0)[0])
    single_model = fresh()
    single_model.load_state_dict(saved)
    out["eval"] = (got - single_model(data(0)[0])).abs().max().item()
    out["eval freed"] = other.a._mdp_unit.flat.untyped_storage().nbytes()
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fully_shard_trains_to_one_process_and_holds_only_its_rows(world_size):
    for rank, out in enumerate(mdp.spawn(cases, world_size, backend="gloo", timeout=240)):
        for key in (*OPTIMIZERS, "kept after forward", "accumulate x2", "clip", "grad rows",
                    "loaded", "eval"):
            assert out[key] <= 1e-6, (key, out[key])
        assert out["loaded differs from fresh"] > 1e-3  # the load did something
        assert out["freed"] == [0] * 5  # four layers and the root (its empty parameter)
        chunk = -(-5 // world_size)
        assert out["rows"][0] == max(0, min(5, (rank + 1) * chunk) - rank * chunk)
        assert out["rows"][2] == (0,)
        assert out["frozen grad"] is None
        assert out["eval freed"] == 0


def test_refusals_are_one_line():
    tied = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    tied[1].weight = tied[0].weight
    for call, words in ((lambda: zero.fully_shard(tied), "tied"),
                        (lambda: zero.fully_shard([nn.Linear(2, 2)]), "one module"),
                        (lambda: zero.fully_shard(nn.Linear(2, 2), shard_placement_fn=len),
                         "dim-0")):
        with pytest.raises(MicroDDPError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
    m = zero.fully_shard(nn.Linear(2, 2))
    with pytest.raises(MicroDDPError, match="already"):
        zero.fully_shard(m)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(MicroDDPError, match="one dtype"):
        zero.fully_shard(mixed)
