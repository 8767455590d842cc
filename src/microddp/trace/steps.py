"""Traced DDP steps on N ranks: the runs `microddp trace` (commands/trace.py) asks for.

`run_steps` runs a few steps of an engine with spans recorded; `traced_steps` also writes
trace.json, timeline.png and metrics.jsonl; `record` runs that on N ranks; `overhead_times`
times plain, traced and monitored steps side by side.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from .. import spans
from ..launch.spawn import spawn
from ..world.world import World, distributed
from . import report as trace_report


def _traced_torch_ddp(module: nn.Module, bucket_cap_mb: float) -> nn.Module:
    """PyTorch's own DDP, with a comm hook that averages exactly as its default and times it."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    def hook(state, bucket):  # unannotated: torch checks annotations, and ours are strings
        launched = time.perf_counter()
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            spans.add_span(f"allreduce bucket {bucket.index()}", launched, time.perf_counter(),
                           track="comm", bucket=bucket.index(), bytes=buf.numel() * buf.element_size())
            return f.value()[0]

        return fut.then(done)

    ddp.register_comm_hook(None, hook)
    # torch waits for its buckets inside backward, in C++; the last gradient's arrival marks
    # where that wait begins, so the trace can show it as such rather than as compute.
    last = ddp._microddp_last_grad = [0.0]
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: last.__setitem__(0, time.perf_counter()))
    return ddp


def note_wait(model: nn.Module) -> None:
    """After backward of a traced torch DDP: record its hidden end-of-backward wait."""
    last = getattr(model, "_microddp_last_grad", None)
    if last is not None and last[0] > 0:
        spans.add_span("wait comm", last[0], time.perf_counter(), track="comm_wait")


def traced_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor) -> None:
    """One training step with forward, backward (and its wait for communication) and
    optimizer spans; the spans are dropped when no recorder is active."""
    with spans.span("forward"):
        loss = nn.functional.cross_entropy(model(x), y)
    with spans.span("backward"):
        loss.backward()
        note_wait(model)
    with spans.span("optimizer", track="optim"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    spans.next_step()


def wrap(module: nn.Module, engine: str, bucket_cap_mb: float = 25.0) -> nn.Module:
    """A data-parallel wrapper whose communication shows up in the trace."""
    if engine == "torch":
        return _traced_torch_ddp(module, bucket_cap_mb)
    from ..dp import wrap as dp_wrap

    return dp_wrap(module, engine, bucket_cap_mb=bucket_cap_mb)


def run_steps(world: World, engine: str = "overlap", dim: int = 256, depth: int = 8,
              batch: int = 64, steps: int = 10, bucket_cap_mb: float = 1.0) -> nn.Module:
    """Train FullMLP for `steps` SGD steps, marking spans (recorded only if tracing is on).

    `batch` is per rank; the data is synthetic, a different shard on each rank.
    """
    from ..model import FullMLP

    torch.manual_seed(0)
    model = wrap(FullMLP(dim, depth).to(world.device), engine, bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + world.rank)
    batches = [(torch.randn(batch, dim, generator=gen),
                torch.randint(0, 2, (batch,), generator=gen)) for _ in range(min(steps, 4))]
    for i in range(steps):
        with spans.span("data", track="data"):
            x, y = (t.to(world.device) for t in batches[i % len(batches)])
        traced_step(model, opt, x, y)
    return model


def traced_steps(world: World, run_dir: str, **kwargs) -> dict:
    """`run_steps` with the recorder on; returns trace_report.finish's summary."""
    spans.start()
    run_steps(world, **kwargs)
    return trace_report.finish(run_dir, world)


def _run_job(world: World, run_dir: str, kwargs: dict) -> dict:
    from ..monitor import flight

    flight.set_run_dir(run_dir)  # a hang's Flight Recorder dumps go with the trace
    return traced_steps(world, run_dir, **kwargs)


def _overhead_job(world: World, kwargs: dict, repeats: int) -> dict[str, list[float]]:
    """Step times with nothing on, with the recorder on, and with the collective monitor on."""
    from .. import monitor
    from ..model import FullMLP
    from ..monitor import patch
    from ..timing import interleaved

    torch.manual_seed(0)
    dim, batch = kwargs["dim"], kwargs["batch"]
    model = wrap(FullMLP(dim, kwargs["depth"]), kwargs["engine"], kwargs["bucket_cap_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, dim), torch.randint(0, 2, (batch,))
    mon = monitor.enable(timeout=120) if distributed() else None
    rec = spans.Recorder()

    def step(recording: bool, monitoring: bool) -> None:
        patch._active = mon if monitoring else None  # wrappers stay installed: one lookup
        with spans.use(rec if recording else None):
            traced_step(model, opt, x, y)

    sync = dist.barrier if distributed() else None
    # "control" is plain again, last in each round: its ratio to plain is the noise floor.
    out = interleaved({"plain": lambda: step(False, False), "traced": lambda: step(True, False),
                       "monitored": lambda: step(False, True),
                       "control": lambda: step(False, False)}, repeats, warmup=3, sync=sync)
    monitor.disable()
    return out


def overhead_times(nproc: int, kwargs: dict, steps: int,
                   timeout: float) -> dict[str, list[float]]:
    """Step times of plain, traced, monitored and control (plain again) runs, interleaved."""
    # CPU model and batches, on gloo even on a GPU host: the cost measured is the Python
    # bookkeeping of spans and monitor records, which the CPU pays either way.
    return spawn(_overhead_job, nproc, args=(kwargs, steps), timeout=timeout,
                 backend="gloo")[0]


def record(out: str, nproc: int, kwargs: dict, timeout: float) -> dict:
    """Trace `kwargs["steps"]` steps on `nproc` ranks into folder `out`; rank 0's summary."""
    return spawn(_run_job, nproc, args=(out, kwargs), timeout=timeout)[0]
