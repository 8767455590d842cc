"""A torch.distributed backend named "microddp", so an unchanged PyTorch script runs on
microddp's shared-memory collectives:

    import microddp.backend  # registers the "microddp" backend with torch.distributed
    dist.init_process_group("microddp")

Importing this module registers it (as out-of-tree backends do: importing a plugin makes its
name known to `init_process_group`); `register()` does it again, under another name if asked.
`import microddp` alone does not: it imports no torch (the `microddp` command starts without
it), and registering means importing torch.distributed.

A group of this backend sends CPU collectives between ranks of one host through shared memory
and everything else (other hosts, CUDA tensors, ops shared memory does not carry) to a gloo
group formed beside it: process_group.py says which goes where.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .process_group import MicroDDPProcessGroup

NAME = "microddp"

__all__ = ["NAME", "MicroDDPProcessGroup", "register"]


def _create(options: dist.distributed_c10d._DistributedBackendOptions,
            backend_options=None) -> MicroDDPProcessGroup:
    """torch's constructor call for a new group of this backend (the extended form, which
    also gives the group's name: shared memory's set-up keys are per group)."""
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(
        milliseconds=options.timeout)
    return MicroDDPProcessGroup(options.store, options.group_rank, options.group_size, timeout,
                                str(options.group_id))


def register(name: str = NAME) -> None:
    """Make `dist.init_process_group(name)` and `dist.new_group(backend=name)` build microddp
    groups. Any process may call it again (the same name: no change)."""
    # devices as a list: torch iterates it (a bare "cpu" would register "c", "p" and "u").
    # CUDA too, so a script that moves a tensor to a GPU gets gloo's answer, not an error.
    dist.Backend.register_backend(name, _create, extended_api=True, devices=["cpu", "cuda"])


register()
