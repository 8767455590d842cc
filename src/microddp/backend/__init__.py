"""A torch.distributed backend named "microddp", so an unchanged PyTorch script runs on
microddp's shared-memory collectives:

    import microddp.backend  # registers the "microddp" backend with torch.distributed
    dist.init_process_group("microddp")

Importing this module registers it (as out-of-tree backends do: importing a plugin makes its
name known to `init_process_group`); `register()` does it again, under another name if asked.
`import microddp` alone does not: it imports no torch (the `microddp` command starts without
it), and registering means importing torch.distributed.

Where microddp is installed (pip install), `import torch` registers it too, with no import of
microddp in the script: torch loads every entry point of its `torch.backends` group at the end
of `import torch` (its plugin mechanism for out-of-tree extensions; TORCH_DEVICE_BACKEND_AUTOLOAD=0
turns it off), and microddp declares `autoload` there (pyproject.toml). So this module stays
light: the group class (process_group.py, which imports the shared-memory collectives) is
imported when torch builds the first group, not when the name is registered.

A group of this backend sends CPU collectives between ranks of one host through shared memory
and everything else (other hosts, CUDA tensors, ops shared memory does not carry) to a gloo
group formed beside it: process_group.py says which goes where.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

NAME = "microddp"
# What to do when torch does not know the name (a script without the import, where the entry
# point is not installed or autoloading is off): every message that names the backend says it.
IMPORT_HINT = (f'the "{NAME}" backend is registered by `import microddp.backend`: add that '
               f'line before dist.init_process_group("{NAME}")')

__all__ = ["NAME", "IMPORT_HINT", "MicroDDPProcessGroup", "register", "autoload"]


def __getattr__(name: str):
    if name == "MicroDDPProcessGroup":  # imported on first use: see the module docstring
        from .process_group import MicroDDPProcessGroup
        return MicroDDPProcessGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _create(options: dist.distributed_c10d._DistributedBackendOptions, backend_options=None):
    """torch's constructor call for a new group of this backend (the extended form, which
    also gives the group's name: shared memory's set-up keys are per group)."""
    from .process_group import MicroDDPProcessGroup

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


def autoload() -> None:
    """The `torch.backends` entry point: register the name at `import torch`. Never raises:
    torch turns an entry point's error into a failed `import torch`, for every script here."""
    try:
        if dist.is_available() and NAME not in dist.Backend.backend_list:
            register()
    except Exception:  # noqa: BLE001, S110 - see the docstring; the import still works
        pass


register()
