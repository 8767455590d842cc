"""Log every collective by wrapping torch.distributed's functions while monitoring is on.

microddp.comms (and any user code) calls them through the `torch.distributed` module, so the
wrappers see every call without a change to the callers.

Two ways to wait. By default a call runs as it would without the monitor: the wrapper notes it
(a sequence number, the time, the arguments and the caller's frame, described only if a report
asks) and the watchdog thread reports a call that takes longer than the monitor's timeout. A
blocking gloo call then ends on the process group's own timeout, in a MicroDDPError carrying
the report; anything else (NCCL, an async op, microddp's own collectives) is ended by the
watchdog after the report (`abort`). That costs some Python per call (tens of
microseconds under a profiler; docs/07-observability.md: what it does to a small collective). With
`interrupt`, a blocking gloo call is launched async and waited on with the monitor's timeout,
so a stall raises the report in the caller after the monitor's timeout, however long the
process group's is; that costs a hand-over to gloo's thread and back on every call (~0.1-0.2
ms for a small one), so it is on only when it buys something (see Monitor.interrupt). NCCL
calls are never converted (waiting on the CPU would serialise the GPU).

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
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from ..errors import MicroDDPError, PeerError
from ..shm import segment as shm
from . import desync
from .hang import Monitor
from .log import WRAPPER_CODES, Entry, describe_tensor

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
    """The name a report uses for `group`: `world` for the default one."""
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return str(getattr(group, "group_name", id(group)))
    except RuntimeError:  # a ProcessGroup built directly has none ("ProcessGroup name not set")
        return f"group {id(group):x}"


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
    """This rank is not in `group`: torch (and microddp) skip the call, nobody waits for it.
    Asked once per group (see _gloo_groups)."""
    if group is None:
        return False
    hit = _outside_groups.get(id(group))
    if hit is not None and hit[0]() is group:
        return hit[1]
    if group is dist.GroupMember.WORLD:
        outside = False
    else:
        try:
            outside = dist.get_rank(group) < 0
        except (ValueError, RuntimeError):  # a group torch does not know (built directly, or
            outside = False  # a Python one): it has no global ranks, and this rank is in it
    try:
        _outside_groups[id(group)] = (weakref.ref(group), outside)
    except TypeError:  # not a group object: asked again next time
        pass
    return outside


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
        """Wait for the work, no longer than the monitor's deadline; a failure becomes a report
        of every rank."""
        mon, entry = self._mon, self._entry
        left = mon.timeout_s - (time.monotonic() - entry.started)
        try:
            ok = self._work.wait(timeout or timedelta(seconds=max(left, 0.05)))
        except RuntimeError as e:
            raise PeerError(mon.collect(entry, why=_first_line(e))) from None
        mon.log.end(entry)
        return ok

    def get_future(self) -> Any:
        # The caller will wait on the future, not on us: the watchdog must speak for it.
        """The work's future; the watchdog then reports a hang, since no wait() here will."""
        self._entry.escapable = False
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:  # is_completed, result, exception, ...
        return getattr(self._work, name)


def _launch(mon: Monitor, entry: Entry, start: Callable, args: tuple, kwargs: dict) -> Any:
    """Start an async call; its Work, or None (nothing in flight: the entry is closed). A call
    refused at launch (bad arguments) is the caller's error, not a hang: its entry is closed
    too, since left open the watchdog would report it as a stall."""
    try:
        work = start(*args, **kwargs)
    except BaseException:
        mon.log.end(entry)
        raise
    if work is None:
        mon.log.end(entry)
    return work


def _reported(mon: Monitor, entry: Entry, e: RuntimeError) -> RuntimeError:
    """What a collective's failure becomes: the hang report if the backend gave up on it (or
    a report was made already), else the error itself (arguments refused at once)."""
    if isinstance(e, MicroDDPError) or (mon.report is None and not _backend_failed(e)):
        return e
    return PeerError(mon.collect(entry, why=_first_line(e), own=False))


def _raise_reported(mon: Monitor, entry: Entry, e: RuntimeError) -> NoReturn:
    """Raise what `e` becomes (_reported): `e` itself, traceback kept, when the call was
    refused at once (the caller's error, not a hang); else the report, in its place."""
    err = _reported(mon, entry, e)
    if err is e:
        raise e
    raise err from None


def failed_wait(error: RuntimeError) -> BaseException:
    """What a wait on an async call's Work (comms' Handle, DDP's buckets) raises when it
    failed: the report of every rank if the backend gave up, about the oldest call still
    open; `error` itself if no monitor runs or the call was refused at once. Needed when the
    group's timeout ends the wait before the watchdog's threshold (MICRODDP_TIMEOUT below the
    monitor's timeout), which would otherwise leave gloo's bare timeout."""
    mon = _active
    if mon is None:
        return error
    return _reported(mon, mon.log.oldest_failed() or mon.log.oldest_open(), error)


class _Signature:
    """Where a wrapped function's arguments are, found once per function: inspect's bind()
    costs ~20 us a call, a position lookup well under one."""

    def __init__(self, fn: Callable) -> None:
        params = inspect.signature(fn).parameters
        self.names = list(params)
        self.defaults = {k: p.default for k, p in params.items() if k in _DETAIL_ARGS
                         and p.default is not inspect.Parameter.empty}
        self.group_at = self.names.index("group") if "group" in params else -1
        # the argument describe() names (the first of _TENSOR_ARGS the function takes)
        self.tensor_name = next((k for k in _TENSOR_ARGS if k in params), None)
        self.tensor_at = self.names.index(self.tensor_name) if self.tensor_name else -1
        self.async_at = self.names.index("async_op") if "async_op" in params else -1

    def group(self, args: tuple, kwargs: dict) -> Any:
        i = self.group_at
        return args[i] if 0 <= i < len(args) else kwargs.get("group")

    def async_op(self, args: tuple, kwargs: dict) -> bool:
        i = self.async_at
        return bool(args[i] if 0 <= i < len(args) else kwargs.get("async_op"))

    def bind(self, args: tuple, kwargs: dict) -> dict:
        a = dict(self.defaults)
        a.update(zip(self.names, args, strict=False))
        a.update(kwargs)
        return a

    def pick(self, args: tuple, kwargs: dict) -> Any:
        """The argument describe() names, found by position: cheap enough for every call."""
        i = self.tensor_at
        return args[i] if 0 <= i < len(args) else kwargs.get(self.tensor_name)

    def describe(self, args: tuple, kwargs: dict) -> tuple[str, str]:
        """(shape, detail) of a call: what a report and the debug comparison name."""
        a = self.bind(args, kwargs)
        return next((describe_tensor(a[k]) for k in _TENSOR_ARGS if k in a), ""), _detail(a)


# What a torch Future chained with .then() puts in front of the error of the future it
# waited on, once per link of the chain (a comm hook's fp16 compression: three times).
_CHAINED = re.compile(r"^(?:Got the following error when running the callback: [\w.]+: )+")


def _text(e: BaseException) -> str:
    """The error's message, without the chained futures' prefixes (_CHAINED)."""
    return _CHAINED.sub("", str(e).lstrip())


def _first_line(e: BaseException) -> str:
    text = _text(e)
    return text.splitlines()[0] if text else type(e).__name__


def _backend_failed(e: RuntimeError) -> bool:
    """The backend gave up waiting or lost a peer (gloo's "[.../gloo/...] Timed out ...",
    "Connection closed by peer"; NCCL's DistBackendError), rather than refusing the arguments
    at once: a report is worth gathering. Also under a chain of futures (a comm hook's)."""
    chain = _CHAINED.match(str(e).lstrip())
    if chain is not None and "DistBackendError" in chain.group(0):
        return True  # NCCL's, under a comm hook's chain of futures
    first = _text(e)
    return isinstance(e, getattr(dist, "DistBackendError", ())) or (
        first.startswith("[") and "gloo" in first[:first.find("]")])


def _wrap(name: str, fn: Callable, torch_own: bool, lean: bool = False) -> Callable:
    sig = _Signature(fn)
    at = sig.async_at

    def leanly(mon: Monitor, group: Any, args: tuple, kwargs: dict) -> Any:
        """A blocking call through shared memory (`lean`; its caller is in `group`): logged as
        any other, but without taking its caller's frame (found on its thread if a report
        asks while it runs: log.Entry._frame_now), since making a frame object per call
        cost more than a small all-reduce's own work (docs/measured/04c-shared-memory.md).
        It ends itself at the group's timeout, with the report (shm/segment.py)."""
        entry = mon.log.begin("world" if group is None else group_name(group), name,
                              (sig.describe, args, kwargs, sig.pick))
        entry._thread = threading.get_ident()
        entry.ends_itself = True
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            _raise_reported(mon, entry, e)
        finally:
            mon.log.end(entry)

    def as_async(*args: Any, **kwargs: Any) -> Any:
        if len(args) > at:
            return fn(*args[:at], True, *args[at + 1:], **kwargs)
        return fn(*args, **{**kwargs, "async_op": True})

    def interrupting(mon: Monitor, entry: Entry, group: Any, args: tuple, kwargs: dict,
                     first: Callable | None) -> Any:
        """monitor.enable(interrupt=True) or debug: a blocking gloo call runs async and is
        waited on with the monitor's timeout, so its stall raises the report here."""
        entry.settle()
        if mon.debug:
            desync.check(mon, entry, group)
        _first(mon, entry, first)
        gloo = _gloo(group)
        async_op = sig.async_op(args, kwargs)
        if async_op or (at >= 0 and gloo):
            work = _launch(mon, entry, fn if async_op else as_async, args, kwargs)
            if work is None:
                return None
            if async_op:
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
        except MicroDDPError as e:
            if not getattr(e, "timed_out", False):  # a shared-memory Work's wait ran out
                raise
            raise PeerError(mon.collect(entry, why=_first_line(e))) from None
        except RuntimeError as e:
            raise PeerError(mon.collect(entry, why=_first_line(e))) from None
        finally:
            mon.log.end(entry)

    # The hot path below makes as few Python calls as it can (each costs about a microsecond
    # on a loaded machine): the group and async_op are read by position here, not by calls.
    group_at, async_at, describe, pick = sig.group_at, sig.async_at, sig.describe, sig.pick

    def call(first: Callable | None, *args: Any, **kwargs: Any) -> Any:
        mon = _active
        group = None
        if mon is not None:
            group = args[group_at] if 0 <= group_at < len(args) else kwargs.get("group")
        if mon is None or (group is not None and _outside(group)):
            if first is not None:
                first()
            return fn(*args, **kwargs)
        if lean and first is None and not (mon.interrupt or mon.debug
                                           or sig.async_op(args, kwargs)):
            return leanly(mon, group, args, kwargs)
        # The arguments and the caller's frame, held while the call runs: described only if
        # a report (or debug mode) asks, not on every call.
        # frame 2: the caller of wrapper() or of after(), which call this directly
        entry = mon.log.begin("world" if group is None else group_name(group), name,
                              (describe, args, kwargs, pick), sys._getframe(2))
        if mon.interrupt or mon.debug:
            return interrupting(mon, entry, group, args, kwargs, first)
        # A gloo op fails by itself at the process group's timeout (async or not): after the
        # report, the watchdog leaves the ending to it, in a MicroDDPError raised below.
        entry.ends_itself = torch_own and _gloo(group)
        if first is not None:
            _first(mon, entry, first)
        if args[async_at] if 0 <= async_at < len(args) else kwargs.get("async_op"):
            entry.locate_caller()  # the caller moves on; the Work keeps the tensors anyway
            work = _launch(mon, entry, fn, args, kwargs)
            if work is None:
                return None
            entry.work = work  # the watchdog polls it
            # torch's own Work, never a wrapper: torch hands Works to C++ (DDP's reducer under
            # Join takes its forward all-reduce's), which refuses a Python object. A stalled
            # wait then fails with gloo's error, after the watchdog has printed the report.
            return work
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            _raise_reported(mon, entry, e)
        finally:
            mon.log.end(entry)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call(None, *args, **kwargs)

    wrapper.__microddp_original__ = fn
    wrapper.__microddp_after__ = call
    WRAPPER_CODES.add(call.__code__)  # where a lean entry's caller is found (leanly)
    return wrapper


def _first(mon: Monitor, entry: Entry, first: Callable | None) -> None:
    """Run the step a call makes before it starts (comms' agreement of the ranks) inside the
    call's entry: a peer that never arrives is then reported as this call. Its own waits end
    at the group's timeout, with the report (shared memory's reporter), or refuse at once."""
    if first is None:
        return
    try:
        first()
    except RuntimeError as e:  # a gloo wait of the agreement gave up: the report, as a call's
        try:
            _raise_reported(mon, entry, e)
        finally:
            mon.log.end(entry)
    except BaseException:
        mon.log.end(entry)
        raise


def after(first: Callable[[], None], fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) with `first()` run just before it, as one call: where `fn` is a
    wrapped collective, inside its log entry (comms' agreement and the call it guards are one
    collective to the hang report); else simply one, then the other."""
    call = getattr(fn, "__microddp_after__", None)
    if call is None:
        first()
        return fn(*args, **kwargs)
    return call(first, *args, **kwargs)


# id(group) -> (a weak reference to it, is it gloo's): asked once per group, and then found
# with one dict lookup (a WeakKeyDictionary's costs a Python call and a new weak reference
# per call). Held weakly: a strong key kept every group the monitor saw alive after
# destroy_process_group, with its threads (world/teardown.py); the reference also tells a
# new group that took a dead one's id.
_gloo_groups: dict[int, tuple[Any, bool]] = {}
_outside_groups: dict[int, tuple[Any, bool]] = {}  # the same, for "is this rank outside it"


def _default_group() -> Any:
    """dist.GroupMember.WORLD, read without its two property calls where torch keeps it as
    an attribute (_World._default_pg in torch 2.x), else through the public name."""
    try:
        return _c10d._world._default_pg
    except AttributeError:
        return dist.GroupMember.WORLD


def _gloo(group: Any) -> bool:
    key = group if group is not None else _default_group()
    hit = _gloo_groups.get(id(key))
    if hit is not None and hit[0]() is key:
        return hit[1]
    gloo = _backend(group) == "gloo"
    if key is not None:
        try:
            _gloo_groups[id(key)] = (weakref.ref(key), gloo)
        except TypeError:  # not a group object: asked again next time
            pass
    return gloo


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


def _routes() -> list[tuple[Any, str, str]]:
    """microddp.comms.all_reduce's shared-memory path (collectives/route.py), logged under
    the name the caller used: all_reduce."""
    return [(importlib.import_module("microddp.collectives.route"), "all_reduce", "all_reduce")]


def _describe_reduction(args: tuple, kwargs: dict) -> tuple[str, str]:
    return describe_tensor(args[0]), kwargs["op"]


def _observer(mon: Monitor) -> Callable:
    """What collectives/hierarchical.py calls as DDP starts a bucket's hierarchical all-reduce
    (on its own thread, through the hierarchy's sub-groups, so none of the wrappers above sees
    it): the reduction is logged as hierarchical_all_reduce until it ends, and a failure of
    the backend (a peer lost, its timeout) becomes the report of every rank."""

    def observe(data: Any, op: str, frame: Any) -> Callable:
        entry = mon.log.begin("world", "hierarchical_all_reduce",
                              (_describe_reduction, (data,), {"op": op}), frame)
        entry.locate_caller()  # the caller moves on (backward goes on computing)
        # Its gloo waits end at the world's timeout, in the report below: after the
        # watchdog's report, nothing for it to end.
        entry.ends_itself = True

        def ended(error: BaseException | None) -> BaseException | None:
            try:
                if isinstance(error, RuntimeError):
                    return _reported(mon, entry, error)
                return error
            finally:
                mon.log.end(entry)

        return ended

    return observe


def install(mon: Monitor) -> None:
    """Route torch.distributed's and microddp.collectives' collectives through the wrappers."""
    global _active
    _active = mon
    targets = [(dist, name, name) for name in COLLECTIVES] + _ours() + _routes()
    for module, attr, name in targets:
        fn = getattr(module, attr, None)
        if fn is None or (module, attr) in _originals:
            continue
        _originals[module, attr] = fn
        # Like gloo's own calls, the shared-memory ones end by themselves at the group's
        # timeout (`ends_itself`), with this monitor's report (set_reporter).
        ours = getattr(fn, "ends_itself", False) and module is not dist
        setattr(module, attr, _wrap(name, fn, torch_own=module is dist or ours,
                                    lean=ours and getattr(fn, "lean", False)))
    shm.set_reporter(lambda why: mon.collect(mon.log.oldest_open(), why=why))
    importlib.import_module("microddp.collectives.hierarchical").observe_with(_observer(mon))


def uninstall() -> Monitor | None:
    """Put the original functions back."""
    global _active
    mon, _active = _active, None
    shm.set_reporter(None)
    importlib.import_module("microddp.collectives.hierarchical").observe_with(None)
    for (module, attr), fn in _originals.items():
        setattr(module, attr, fn)
    _originals.clear()
    _gloo_groups.clear()  # let go of the groups: the next job forms new ones
    _outside_groups.clear()
    return mon


def active() -> Monitor | None:
    """The monitor installed in this process, or None."""
    return _active


def point_to_point(op: str, side: str, peer: int | None, tensor: Any,
                   wait: Callable[[], Any]) -> Any:
    """A blocking send or receive of comms (comms/p2p.py), logged while `wait()` runs: two
    ranks that both receive (or both send) are then named by the hang report, each with the
    peer it waits for (`side`: dst or src). In a log of its own ("p2p"): the ranks' sends and
    receives differ by design, so they take no part in the collectives' numbering or their
    comparison (debug). Its wait ends at the group's timeout, after the report."""
    mon = _active
    if mon is None:
        return wait()
    detail = f"{side}={'any' if peer is None else peer}"
    entry = mon.log.begin("p2p", op, (lambda a, k: (describe_tensor(tensor), detail), (), {},
                                      lambda a, k: tensor), sys._getframe(1))
    entry.ends_itself = True
    try:
        return wait()
    except RuntimeError as e:
        _raise_reported(mon, entry, e)
    finally:
        mon.log.end(entry)
