"""One entry point for every rank of a parameter-server run: rank 0 serves, the others work."""

from __future__ import annotations

from ..comms import World
from .config import SERVER, PSConfig
from .server import ServerReport, run_server
from .task import Task
from .worker import WorkerReport, run_worker


def run(world: World, task: Task, config: PSConfig) -> ServerReport | WorkerReport:
    """Run this rank's part: the server's report on rank 0, the worker's on the others."""
    config.check(world.world_size)
    if world.rank == SERVER:
        return run_server(world.world_size, task, config)
    return run_worker(world.rank, world.world_size, task, config)
