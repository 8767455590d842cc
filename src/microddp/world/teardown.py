"""Leaving cleanly: a process that did its work must exit 0, every time.

A gloo process group runs worker threads. When one of them drops the last reference to a
finished collective, it frees that collective's tensors, which takes the GIL. If the group is
still alive while Python finalises, a worker that comes to that point then finds the
interpreter gone and the process dies with "terminate called without an active exception"
(SIGABRT) after its last line of output. On a busy machine a worker can lag that long.

`destroy_process_group` only lets go of torch's own references. The group object, and with
it the threads, lives on while anything else holds it, and one holder is inside torch:
`torch.distributed.nn.functional` takes `group.WORLD` as a default argument when it is first
imported, and creating the first optimizer imports it (through torch._dynamo). If the group
exists at that moment, it can never be freed (ZeroRedundancyOptimizer's and FSDP's grad
scaler's modules do the same). So:

- `before_group()` imports that module before the group is formed, so its defaults are None;
- `release()`, after `destroy_process_group`, makes sure the groups are really freed (their
  destructor stops and joins the workers while the interpreter is alive): it unbinds the
  groups from torch.distributed's default arguments (where a module was first imported after
  the group, or the script formed its group itself), collects cycles, and warns about a group
  that something else still holds.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
import weakref

import torch.distributed as dist


def before_group() -> None:
    """Import the torch modules that would capture the default group if imported after it."""
    import torch.distributed.nn  # noqa: F401  (defaults bound now are None, not the group)


def watch() -> list[weakref.ref]:
    """Weak references to every live process group, taken before they are destroyed."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    groups = list(dist.distributed_c10d._world.pg_map)
    return [weakref.ref(pg) for pg in groups]


def release(watched: list[weakref.ref]) -> list:
    """After destroy_process_group: free the groups in `watched`; return those still held."""
    alive = [r() for r in watched if r() is not None]
    if not alive:
        return []
    _forget_defaults(alive)
    del alive
    gc.collect()  # a cycle (a model with hooks, say) may be what still holds one
    held = [r() for r in watched if r() is not None]
    if held:
        names = sorted({name for g in held for name in holders(g)})
        by = f" (held by {', '.join(names)})" if names else ""
        warnings.warn(
            f"microddp.shutdown: {len(held)} process group(s) are still referenced after "
            f"destroy_process_group{by}, so their worker threads run until exit, which can "
            "abort the process at exit (SIGABRT); drop those objects (e.g. `del model`) "
            "before shutdown()", RuntimeWarning, stacklevel=3)
    return held


def holders(group) -> list[str]:
    """What holds `group`, as a person would name it: an object's attribute (`torch.nn.
    parallel.distributed.DistributedDataParallel.process_group`), a module's global, a
    function's local. A reference from C++ (a reducer's) shows only through its Python
    owner, when it has one."""
    out = []
    for ref in gc.get_referrers(group):
        if isinstance(ref, dict):
            attr = next((k for k, v in ref.items() if v is group), "?")
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            if owners:
                t = type(owners[0])
                where = (f"module {owners[0].__name__}" if isinstance(owners[0], types.ModuleType)
                         else f"{t.__module__}.{t.__qualname__}")
                out.append(f"{where}.{attr}")
            elif ref.get("__name__") == "__main__":
                out.append(f"the script's global {attr}")
        elif isinstance(ref, types.FrameType):
            out.append(f"a local variable of {ref.f_code.co_name}()")
    return out


def _forget_defaults(groups: list) -> None:
    """Put None where a torch.distributed function took one of `groups` as a default value
    (None means the default group to all of them, as it did when they were written)."""
    ids = {id(g) for g in groups}
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for obj in list(vars(module).values()):
            # type(), not isinstance(): some objects (torch.distributed.reduce_op) warn on any
            # attribute access, __class__ included.
            members = vars(obj).values() if issubclass(type(obj), type) else (obj,)
            for fn in members:
                if type(fn) in (staticmethod, classmethod):
                    fn = fn.__func__
                if type(fn) is not types.FunctionType:
                    continue
                defaults = fn.__defaults__
                if defaults and any(id(d) in ids for d in defaults):
                    fn.__defaults__ = tuple(None if id(d) in ids else d for d in defaults)
                kw = fn.__kwdefaults__
                if kw and any(id(d) in ids for d in kw.values()):
                    fn.__kwdefaults__ = {k: None if id(d) in ids else d for k, d in kw.items()}
