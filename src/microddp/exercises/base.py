"""What every exercise shares: the learner's file loaded by path, real ranks to run it on, and
problems said in a learner's words.

An exercise is a chapter's key function with its body removed (`starter`). `check(path)`
loads the learner's version from `path` and runs it, on real ranks where the idea is
distributed, beside the library's own implementation of the same thing (the reference
solution is microddp itself), and returns what is wrong: which rank, which case, expected
against got, and a hint where the mistake has a common cause. An empty list means solved.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MicroDDPError
from ..launch.spawn import spawn

DEADLINE_S = 30.0  # per run of the ranks: a deadlock in the learner's code ends here


@dataclass(frozen=True)
class Exercise:
    """One exercise: its name on the command line, its chapter, the function the learner
    writes, the starter file, and the check."""

    name: str
    chapter: str
    title: str
    function: str
    starter: str
    check: Callable[[str], list[str]]


class Unsolved(Exception):
    """A problem found while checking: its message is the learner-facing sentence."""


def load(path: str | Path, function: str) -> Callable:
    """The learner's `function` from the file at `path`, or MicroDDPError saying why not."""
    path = Path(path)
    if not path.is_file():
        raise MicroDDPError(f"{path} does not exist; `microddp exercise start NAME` writes the "
                            "starter file")
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (a learner's file can fail in any way)
        raise MicroDDPError(f"{path} does not load: {_where(e, path)}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise MicroDDPError(f"{path} has no function {function}(); keep the starter's name")
    return fn


def _where(e: BaseException, path: Path) -> str:
    """The exception in one line, at the learner's own line where it has one."""
    lines = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    at = f" (line {lines[-1].lineno}: {lines[-1].line})" if lines else ""
    if isinstance(e, SyntaxError):
        return f"syntax error at line {e.lineno}: {e.msg}"
    return f"{type(e).__name__}: {e}{at}"


def call(fn: Callable, path: str, function: str, *args) -> Any:
    """Call the learner's function; its exception becomes an Unsolved naming their line."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise Unsolved(f"{function}() is not written yet (it raises NotImplementedError): "
                       "replace that line with your code") from None
    except Unsolved:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unsolved(f"{function}() raised {_where(e, Path(path))}") from None


def on_ranks(worker: Callable, ranks: int, args: tuple, what: str) -> list[Any]:
    """Run `worker(world, *args)` on `ranks` real ranks; a rank's Unsolved (returned as
    ("unsolved", text)) or a deadlock becomes one Unsolved for the learner."""
    try:
        results = spawn(worker, ranks, args=args, timeout=DEADLINE_S)
    except MicroDDPError as e:
        text = str(e)
        if "did not finish within" in text:
            raise Unsolved(f"{what} did not finish within {DEADLINE_S:g} s on {ranks} ranks: "
                           "some rank waits for a message no rank sends (a recv without its "
                           "send, or every rank sending first with blocking calls)") from None
        raise Unsolved(f"{what} on {ranks} ranks failed: {text.splitlines()[0]}") from None
    for rank, r in enumerate(results):
        if isinstance(r, tuple) and r and r[0] == "unsolved":
            raise Unsolved(f"on {ranks} ranks, rank {rank}: {r[1]}")
    return results


def guarded(fn: Callable) -> Callable:
    """Decorate a rank's worker: an Unsolved it raises is returned, so the other ranks' own
    answers still come back and the learner reads one sentence, not a traceback."""
    def worker(world, *args):
        try:
            return fn(world, *args)
        except Unsolved as e:
            return ("unsolved", str(e))
    worker.__name__ = worker.__qualname__ = fn.__name__
    worker.__module__ = fn.__module__
    return worker


def run_checks(cases: Callable[[], None]) -> list[str]:
    """Run an exercise's cases; the first problem found, as the list `check` returns."""
    try:
        cases()
    except Unsolved as e:
        return [str(e)]
    return []
