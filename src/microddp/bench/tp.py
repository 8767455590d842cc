"""microddp's tensor parallelism vs PyTorch's parallelize_module: step time and memory per rank.

Every contender trains its own copy of the same GPT (untied, no dropout: the model both can
run) on the same batch of standard-library text, split over the same ranks: microddp's
TensorParallelGPT (with --sp, sequence parallelism too) and torch's parallelize_module with
the same split (tp/torch_plan.py). Steps are interleaved (a fresh random order each round, a
barrier before each) and the table gives the median step (slowest rank), the ratio
microddp / torch with a 90% bootstrap interval, and with --control the ratio of a second,
identical torch contender to the first (A/A: this run's noise). Memory is measured per rank
in one untimed step of each: the bytes of parameters and gradients this rank holds, and the
peak bytes autograd saved for backward (each storage once; a DTensor's local shard).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from .. import flags
from ..errors import MicroDDPError
from ..timing import compare, interleaved, median

EPILOG = """\
examples:
  microddp bench tp                          # TP 2: microddp vs torch, with and without SP
  microddp bench tp --repeats 10 --control    # with an A/A pair of torch contenders
"""

CONTROL = "torch-2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench tp`: the GPT's sizes, the batch, ranks, repetitions."""
    p.add_argument("-n", "--world-size", type=int, default=2, help="TP ranks (default: 2)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default: 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default: 64)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps each (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--control", action="store_true",
                   help=f"also time a second torch contender ({CONTROL}) and print its ratio to "
                        "the first (A/A)")


class _Saved:
    """Peak bytes autograd saves in one forward (storages counted once, parameters left out)."""

    def __init__(self, params) -> None:
        self.skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in self.skip and s.data_ptr() not in self.seen:
            self.seen.add(s.data_ptr())
            self.bytes += s.nbytes()
        return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard


def _contender(world, name: str, cfg, x, y):
    """A step of `name` and this rank's memory, measured in one untimed step."""
    from ..gpt import GPT
    from ..tp import TensorParallelGPT

    torch.manual_seed(0)
    model = GPT(cfg)
    if name.startswith("microddp"):
        net = TensorParallelGPT(model, None, sequence_parallel=name.endswith("sp"))

        def fwd_bwd() -> None:
            net.loss(x, y).backward()
            net.finish_grads()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import implicit_replication

        from ..tp.torch_plan import finish_grads, parallelize
        net = parallelize(model, init_device_mesh("cpu", (world.world_size,)), name.endswith("sp"))

        def fwd_bwd() -> None:
            with implicit_replication():  # the position embedding: a plain, replicated tensor
                logits = net(x)
                torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                                  y.reshape(-1)).backward()
            finish_grads(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        fwd_bwd()
        opt.step()

    meter = _Saved(net.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        fwd_bwd()
    held = sum(_local(p).numel() * _local(p).element_size() * 2 for p in net.parameters())
    opt.zero_grad()
    return step, {"saved": meter.bytes, "params_grads": held}


def _measure(world, sizes: dict, names: list[str], repeats: int, warmup: int) -> dict:
    from ..gpt import GPTConfig, TextData

    torch.set_num_threads(1)  # one core's worth per rank for every contender alike
    cfg = GPTConfig(vocab_size=256, block_size=sizes["seq"], n_layer=sizes["layers"],
                    n_head=sizes["heads"], d_model=sizes["d_model"], tie_embeddings=False)
    x, y = TextData.load(cfg.block_size, limit_bytes=500_000).batch(
        "train", sizes["batch"], torch.Generator().manual_seed(0))
    steps, memory = {}, {}
    for n in names:
        steps[n], memory[n] = _contender(world, n, cfg, x, y)
    times = interleaved(steps, repeats, warmup, sync=dist.barrier)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return {"times": {n: table[k].tolist() for k, n in enumerate(names)}, "memory": memory}


def run(args: argparse.Namespace) -> int:
    """Check the flags, time the contenders interleaved on spawned ranks, print the table."""
    from ..gpt import GPTConfig
    from ..launch.spawn import spawn
    from ..tp import check_split

    if args.world_size < 2:
        raise MicroDDPError("the TP benchmark needs at least 2 ranks (-n 2)")
    flags.at_least(1, d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq,
                   batch=args.batch, repeats=args.repeats)
    flags.at_least(0, warmup=args.warmup)
    cfg = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    check_split(cfg, args.world_size)
    if args.seq % args.world_size:
        raise MicroDDPError(f"--seq {args.seq} must divide by -n {args.world_size} "
                            "(sequence parallelism splits it)")
    names = ["microddp", "torch", "microddp-sp", "torch-sp"] + ([CONTROL] if args.control else [])
    sizes = {k: getattr(args, k) for k in ("d_model", "layers", "heads", "seq", "batch")}
    ranks = spawn(_measure, args.world_size, args=(sizes, names, args.repeats, args.warmup),
                  timeout=3600, backend="gloo")
    times = ranks[0]["times"]
    print(f"GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, TP {args.world_size}, gloo; median of {args.repeats} "
          "interleaved steps (slowest rank)")
    print(f"{'contender':<13}{'step ms':>9}{'vs torch':>10}{'90% interval':>15}"
          f"{'saved act. KiB':>16}{'params+grads KiB':>18}")
    for n in names:
        base = "torch-sp" if n.endswith("sp") else "torch"
        ratio = ""
        if n != base:
            r, (lo, hi) = compare(times[n], times[base])
            ratio = f"{r:>9.3f}x{lo:>8.3f}-{hi:.3f}"
        mem = max(rank["memory"][n]["saved"] for rank in ranks) / 1024
        held = max(rank["memory"][n]["params_grads"] for rank in ranks) / 1024
        print(f"{n:<13}{median(times[n]) * 1e3:>9.2f}{ratio:<25}{mem:>16.1f}{held:>18.1f}")
    print("vs torch: microddp over torch's parallelize_module with the same split (-sp: both "
          f"with sequence parallelism){'; torch-2: A/A, an identical torch contender' if args.control else ''}")
    print("90% interval = where the ratio lands when this run's rounds are drawn again (a "
          "bootstrap); memory: the largest rank's")
    return 0
