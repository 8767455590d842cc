"""Log every collective by wrapping torch.distributed's functions while monitoring is on.

microddp.comms (and any user code) calls them through the `torch.distributed` module, so the
wrappers see every call without a change to the callers. On gloo a blocking call waits with the
monitor's timeout, so a stall ends in a MicroDDPError carrying the hang report instead of a wait
of the process group's full timeout. NCCL calls are left as they are (waiting on the CPU would
serialise the GPU); the watchdog thread reports their stalls.

microddp.collectives' public functions (ring_all_reduce, ...) are wrapped the same way, as
attributes of the package and of the module defining each: they talk through send/recv, which
the torch wrappers do not see. Their waits are on the process group's timeout, so the watchdog
reports a stall in one (and, with abort, ends the rank). A name imported before enable() (`from
microddp.collectives import ring_all_reduce`) keeps the unwrapped function: call them through
the module (`C.ring_all_reduce`) to have them logged.

A call on a rank outside its group is neither logged nor compared: torch and microddp skip it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import MicroDDPError
from . import desync
from .hang import Monitor
from .log import Entry, describe_tensor, where

COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "scatter", "gather", "barrier", "all_to_all",
    "all_to_all_single", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list",
)
_TENSOR_ARGS = ("tensor", "output_tensor", "output", "tensor_list", "object_list",
                "scatter_object_output_list")
_DETAIL_ARGS = ("op", "src", "dst", "group_src", "group_dst")

_originals: dict[tuple[Any, str], Callable] = {}  # (module, name) -> the function it held
_active: Monitor | None = None


def group_name(group: Any) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return str(getattr(group, "group_name", id(group)))


def _detail(arguments: dict) -> str:
    parts = []
    for k in _DETAIL_ARGS:
        v = arguments.get(k)
        if v is None:
            continue
        if k == "op":
            v = str(getattr(v, "name", v)).lower().removeprefix("redoptype.")
        parts.append(v if k == "op" else f"{k}={v}")
    return " ".join(map(str, parts))


def _outside(group: Any) -> bool:
    """This rank is not in `group`: torch (and microddp) skip the call, nobody waits for it."""
    return group is not None and group is not dist.GroupMember.WORLD and dist.get_rank(group) < 0


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # this rank is not in the group: torch skips the call
        return ""


class MonitoredWork:
    """An async op's Work whose wait() gives up after the monitor's timeout with the report."""

    def __init__(self, work: Any, entry: Entry, mon: Monitor) -> None:
        self._work, self._entry, self._mon = work, entry, mon

    def wait(self, timeout: timedelta | None = None) -> bool:
        mon, entry = self._mon, self._entry
        left = mon.timeout_s - (time.monotonic() - entry.started)
        try:
            ok = self._work.wait(timeout or timedelta(seconds=max(left, 0.05)))
        except RuntimeError as e:
            raise MicroDDPError(mon.collect(entry, why=str(e).splitlines()[0])) from None
        mon.log.end(entry)
        return ok

    def get_future(self) -> Any:
        # The caller will wait on the future, not on us: the watchdog must speak for it.
        self._entry.escapable = False
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:  # is_completed, result, exception, ...
        return getattr(self._work, name)


def _wrap(name: str, fn: Callable) -> Callable:
    params = inspect.signature(fn).parameters
    names = list(params)
    defaults = {k: p.default for k, p in params.items() if k in _DETAIL_ARGS
                and p.default is not inspect.Parameter.empty}
    at = names.index("async_op") if "async_op" in names else -1

    def as_async(args: tuple, kwargs: dict) -> Any:
        if len(args) > at:
            return fn(*args[:at], True, *args[at + 1:], **kwargs)
        return fn(*args, **{**kwargs, "async_op": True})

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mon = _active
        if mon is None:
            return fn(*args, **kwargs)
        a = dict(defaults)  # inspect's bind() costs ~20 us; this ~1 us
        a.update(zip(names, args, strict=False))
        a.update(kwargs)
        if _outside(a.get("group")):
            return fn(*args, **kwargs)
        shape = next((describe_tensor(a[k]) for k in _TENSOR_ARGS if k in a), "")
        entry = mon.log.begin(group_name(a.get("group")), name, shape, _detail(a),
                              where(sys._getframe(1), user=True))
        if mon.debug:
            desync.check(mon, entry, a.get("group"))
        gloo = _backend(a.get("group")) == "gloo"
        if a.get("async_op") or (at >= 0 and gloo):
            try:  # a call refused at launch (bad arguments) is the caller's error, not a hang
                work = fn(*args, **kwargs) if a.get("async_op") else as_async(args, kwargs)
            except BaseException:
                mon.log.end(entry)  # left open, the watchdog would report it as a stall
                raise
            if work is None:
                mon.log.end(entry)
                return None
            if a.get("async_op"):
                entry.work = work
                if not gloo:
                    return work
                entry.escapable = True
                return MonitoredWork(work, entry, mon)
            entry.escapable = True
        try:
            if entry.escapable:  # a blocking gloo call, launched async above: wait for it here
                work.wait(timedelta(seconds=mon.timeout_s))
                return None
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise MicroDDPError(mon.collect(entry, why=str(e).splitlines()[0])) from None
        finally:
            mon.log.end(entry)

    wrapper.__microddp_original__ = fn
    return wrapper


def _ours() -> list[tuple[Any, str, str]]:
    """(module, attribute, name in the log) for microddp.collectives' public functions, in the
    package and in the module that defines each."""
    package = importlib.import_module("microddp.collectives")
    out = []
    for attr in package.__all__:
        fn = getattr(package, attr)
        if not inspect.isfunction(fn) or "group" not in inspect.signature(fn).parameters:
            continue  # traffic(), Traffic: not collectives
        # scatter and gather share torch's names: say whose they are
        name = f"collectives.{attr}" if attr in COLLECTIVES else attr
        out += [(package, attr, name), (sys.modules[fn.__module__], attr, name)]
    return out


def install(mon: Monitor) -> None:
    """Route torch.distributed's and microddp.collectives' collectives through the wrappers."""
    global _active
    _active = mon
    targets = [(dist, name, name) for name in COLLECTIVES] + _ours()
    for module, attr, name in targets:
        fn = getattr(module, attr, None)
        if fn is None or (module, attr) in _originals:
            continue
        _originals[module, attr] = fn
        setattr(module, attr, _wrap(name, fn))


def uninstall() -> Monitor | None:
    """Put the original functions back."""
    global _active
    mon, _active = _active, None
    for (module, attr), fn in _originals.items():
        setattr(module, attr, fn)
    _originals.clear()
    return mon


def active() -> Monitor | None:
    return _active
