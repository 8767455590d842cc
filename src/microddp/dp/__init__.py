"""Data parallelism from scratch: the ladder of stages and the real DistributedDataParallel.

    model = microddp.dp.wrap(FullMLP(128), engine="overlap")   # or naive, hooks, buckets,
                                                               # microddp, torch
"""

from __future__ import annotations

from torch import nn

from ..errors import MicroDDPError

ENGINES = ("naive", "hooks", "buckets", "overlap", "microddp", "torch")
# Constructor arguments of torch's DistributedDataParallel that the ladder stages accept:
# bucket_cap_mb and broadcast_buffers do what torch's do; the others only at torch's default
# (the stages implement neither unused parameters nor static graphs nor bucket views).
_STAGE_KWARGS = {"bucket_cap_mb", "device_ids", "output_device", "broadcast_buffers",
                 "process_group", "find_unused_parameters", "gradient_as_bucket_view",
                 "static_graph"}
_STAGE_DEFAULT_ONLY = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")


def wrap(module: nn.Module, engine: str = "overlap", **ddp_kwargs) -> nn.Module:
    """Wrap `module` for data-parallel training with one of the ladder's engines.

    Every engine behaves like torch's DDP in a loop: replicas start from rank 0's parameters,
    `model(x)` then `loss.backward()` leaves gradients averaged over ranks, and the wrapper
    has `.module` and `.no_sync()`.
    """
    if engine not in ENGINES:
        raise MicroDDPError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "microddp":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel(module, **ddp_kwargs)
    if engine == "torch":
        return _torch_ddp(module, **ddp_kwargs)
    unknown = set(ddp_kwargs) - _STAGE_KWARGS
    if unknown:
        raise MicroDDPError(f"engine {engine!r} does not take {', '.join(sorted(unknown))}; "
                            f"it accepts {', '.join(sorted(_STAGE_KWARGS))}")
    if ddp_kwargs.get("process_group") is not None:
        raise MicroDDPError(f"engine {engine!r} runs on the default group only; "
                            "use engine='microddp' for a process_group")
    for name in _STAGE_DEFAULT_ONLY:
        if ddp_kwargs.get(name):
            raise MicroDDPError(f"engine {engine!r} does not implement {name}=True; "
                                "use engine='microddp' (or 'torch') for it")
    from .engines import StageDDP

    return StageDDP(module, engine, ddp_kwargs.get("bucket_cap_mb"),
                    ddp_kwargs.get("broadcast_buffers", True) is not False)


def _torch_ddp(module: nn.Module, **kwargs) -> nn.Module:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..comms import get_world

    if not (get_world().distributed and dist.is_initialized()):
        raise MicroDDPError("engine 'torch' needs a process group; start several ranks "
                            "(microddp run -n 2 ...) or pick another engine for one process")
    return DistributedDataParallel(module, **kwargs)


def __getattr__(name: str):
    if name in ("DistributedDataParallel", "DDP"):
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'microddp.dp' has no attribute {name!r}")


__all__ = ["ENGINES", "wrap", "DistributedDataParallel", "DDP"]
