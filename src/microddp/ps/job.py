"""One entry point for every rank of a parameter-server run: rank 0 serves, the others work."""

from __future__ import annotations

from ..comms import World
from .config import PSConfig
from .server import ServerReport, run_server
from .task import Task
from .worker import WorkerReport, run_worker


def run(world: World, task: Task, config: PSConfig) -> ServerReport | WorkerReport:
    """Run this rank's part: a server's report on ranks below config.servers (server 0's
    holds the whole model), the worker's on the others."""
    config.check(world.world_size)
    if world.rank < config.servers:
        return run_server(world.world_size, task, config, rank=world.rank)
    return run_worker(world.rank, world.world_size, task, config)
