"""microddp: data parallelism from scratch, done for real."""

from . import comms
from .comms import World, get_world, init, shutdown
from .errors import MicroDDPError
from .spawn import spawn

__version__ = "0.1.0"

__all__ = ["MicroDDPError", "World", "comms", "get_world", "init", "shutdown", "spawn"]
