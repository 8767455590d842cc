"""microddp: data parallelism from scratch, done for real.

    import microddp as mdp
    world = mdp.init()                       # rank, world_size, local_rank, device, backend
    model = mdp.DDP(mdp.FullMLP(128, 16))    # torch's DistributedDataParallel, rebuilt
"""

import sys
from importlib import import_module

from . import upcalls
from .errors import MicroDDPError

__version__ = "0.1.0"

# Everything else loads on first use: `import microddp` imports no torch, so the `microddp`
# command (whose --help, argument errors and launcher need none) starts at once; every
# `microddp.X` below still works as if imported here.
_LAZY = {
    # The world (comms/world.py), re-exported by microddp.comms.
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
    "launch": ("microddp.launch", None),
    "commands": ("microddp.commands", None),
    "trace_report": ("microddp.trace.report", None),
    "train": ("microddp.train", None),
    "zero": ("microddp.zero", None),
}


class _HangMonitor:
    """microddp.monitor as the world's watcher: `init` starts it when it forms a group. The
    world sits below the monitor, so the monitor is handed to it here (through upcalls/,
    without importing comms), and imported only once a group forms (`import microddp`
    stays quick)."""

    def wanted(self, requested: bool | None) -> bool:
        from .monitor.default import wanted

        return wanted(requested)

    def start(self, timeout_s: float) -> None:
        from . import monitor

        monitor.enable(timeout=monitor.stall_seconds(timeout_s))

    def stop(self) -> None:
        monitor = sys.modules.get("microddp.monitor")  # never imported: nothing to stop
        if monitor is not None:
            monitor.disable()

    def failed(self, error: RuntimeError) -> BaseException:
        monitor = sys.modules.get("microddp.monitor")
        return error if monitor is None else monitor.patch.failed_wait(error)


upcalls.watcher = _HangMonitor()


class _SameHostRoute:
    """microddp.collectives' choice of path (shared memory on one host) as comms' route. The
    collectives sit above comms, so they are handed in here (through upcalls/), and imported
    only when a group forms or all-reduces, which then hands comms the real route directly."""

    def _real(self):
        from .collectives import route

        upcalls.route = route.ROUTE
        return route.ROUTE

    def all_reduce_path(self, tensor, op: str, group):
        return self._real().all_reduce_path(tensor, op, group)

    def prepare(self, group) -> None:
        self._real().prepare(group)

    def close(self) -> None:
        """Nothing to let go: no group has used shared memory yet."""


upcalls.route = _SameHostRoute()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'microddp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = import_module(module)
    return getattr(value, attr) if attr else value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})  # the lazy names too, for completion and help()


__all__ = ["MicroDDPError", *_LAZY]
