"""microddp: data parallelism from scratch, done for real.

    import microddp as mdp
    world = mdp.init()                       # rank, world_size, local_rank, device, backend
    model = mdp.DDP(mdp.FullMLP(128, 16))    # torch's DistributedDataParallel, rebuilt
"""

from importlib import import_module

from .errors import MicroDDPError

__version__ = "0.1.0"

# Everything else loads on first use: `import microddp` imports no torch, so the `microddp`
# command (whose --help, argument errors and launcher need none) starts at once; every
# `microddp.X` below still works as if imported here.
_LAZY = {
    # The world (world/world.py) with what comms sets up on it (comms/session.py).
    "comms": ("microddp.comms", None),
    "World": ("microddp.comms", "World"),
    "get_world": ("microddp.comms", "get_world"),
    "init": ("microddp.comms", "init"),
    "shutdown": ("microddp.comms", "shutdown"),
    "spawn": ("microddp.launch.spawn", "spawn"),
    "DistributedDataParallel": ("microddp.dp.ddp", "DistributedDataParallel"),
    "DDP": ("microddp.dp.ddp", "DistributedDataParallel"),
    "FullMLP": ("microddp.model", "FullMLP"),
    # Sub-packages and tools the README and the docs name as microddp.X.
    "backend": ("microddp.backend", None),  # importing it registers torch's "microddp" backend
    "bench": ("microddp.bench", None),
    "collectives": ("microddp.collectives", None),
    "data": ("microddp.data", None),
    "dp": ("microddp.dp", None),
    "gpt": ("microddp.gpt", None),
    "monitor": ("microddp.monitor", None),
    "pipeline": ("microddp.pipeline", None),
    "predict": ("microddp.predict", None),
    "ps": ("microddp.ps", None),
    "tp": ("microddp.tp", None),
    "trace": ("microddp.trace", None),
    "transport": ("microddp.transport", None),
    "shm": ("microddp.shm", None),
    "world": ("microddp.world", None),
    "launch": ("microddp.launch", None),
    "commands": ("microddp.commands", None),
    "trace_report": ("microddp.trace.report", None),
    "train": ("microddp.train", None),
    "zero": ("microddp.zero", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'microddp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = import_module(module)
    return getattr(value, attr) if attr else value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})  # the lazy names too, for completion and help()


__all__ = ["MicroDDPError", *_LAZY]
