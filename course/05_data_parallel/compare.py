"""Chapter 5, all stages side by side: each trains from the same start on the same global
batches; the last column is how far its parameters end from the monolith's.

    python course/05_data_parallel/compare.py          # distributed stages on 2 ranks
    python course/05_data_parallel/compare.py -n 4
"""

import torch
from problem import batches, fresh_model, local, loss_fn, world_size_from_args

import microddp as mdp
from microddp.dp import ladder, wrap

ENGINES = ["naive", "hooks", "buckets", "overlap", "microddp", "torch"]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def single_process() -> dict[str, list[torch.Tensor]]:
    model, opt = fresh_model()
    for x, y in batches():
        ladder.monolith_step(model, opt, loss_fn, x, y)
    pair = [fresh_model(), fresh_model()]
    for x, y in batches():
        ladder.manual_step([m for m, _ in pair], [o for _, o in pair], loss_fn, x, y)
    return {"monolith": params(model), "manual (2 replicas)": params(pair[0][0])}


def distributed(world: mdp.World) -> dict[str, list[torch.Tensor]]:
    """Every engine of microddp.dp.wrap, in the loop one writes for PyTorch's DDP."""
    out = {}
    for engine in ENGINES:
        model, opt = fresh_model()
        ddp = wrap(model, engine, **({"bucket_cap_mb": 1 / 64} if engine != "naive" else {}))
        for x, y in batches():
            xs, ys = local(world, x, y)
            opt.zero_grad()
            loss_fn(ddp(xs), ys).backward()
            opt.step()
        out[engine] = params(model)
    return out


def main() -> None:
    n = world_size_from_args(__doc__)
    results = single_process()
    ranks = mdp.spawn(distributed, n, backend="gloo")
    results.update({f"{e} ({n} ranks)": ranks[0][e] for e in ENGINES})
    ref = results["monolith"]
    print(f"{'stage':<24}{'max |param - monolith|':>24}{'replicas identical':>20}")
    for name, got in results.items():
        diff = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
        engine = name.split(" (")[0]
        same = "-"  # one process: nothing to compare across ranks
        if engine in ENGINES:
            same = str(all(torch.equal(a, b) for r in ranks
                           for a, b in zip(r[engine], got, strict=True)))
        print(f"{name:<24}{diff:>24.3e}{same:>20}")


if __name__ == "__main__":
    main()
