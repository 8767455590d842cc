"""A faster way than the group's backend for some calls, handed in from above.

microddp's shared-memory transport lives in collectives/ (collectives/route.py chooses), above
this layer, so comms does not import it: microddp/__init__.py leaves it in `upcalls.route`,
as it leaves the hang monitor for `init` (upcalls/__init__.py says why there). Without one,
every call goes to torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .. import upcalls


class Route(Protocol):
    """What comms asks the layer above about a group's collectives (collectives/route.py answers)."""
    def all_reduce_path(self, tensor: torch.Tensor, op: str, group) -> Callable | None:
        """all_reduce(tensor, op, group, async_op) to call instead of the backend's, or None."""

    def agree(self, where: str, group, problem: Exception | None, tensor=None, **more) -> None:
        """Raise the same MicroDDPError on every rank of `group` unless all of them called
        `where` with alike `tensor` (shape, dtype, device) and `more` (op, src, ...); this
        rank's `problem`, if any, is raised here after the others have heard of it."""

    def prepare(self, group) -> None:
        """Set `group`'s paths up now: a collective step, called where every rank of the group
        is at the same point (init, new_group), so that the first call finds them ready."""

    def close(self) -> None:
        """Let go of what the paths hold (shutdown calls it before the groups go)."""


def current() -> Route | None:
    """The route installed for comms (`upcalls.route`), or None (every call goes to the
    backend). Looked up at each call: the package installs it when it is imported, and
    replaces its stand-in with collectives' own route once a group first uses it."""
    return upcalls.route
