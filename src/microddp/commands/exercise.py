"""Course exercises: write a chapter's key function yourself, then check it on real ranks.

`list` shows them, `start NAME` writes the starter file (the function with its body removed,
its docstring saying what to write), `check NAME FILE` runs your version beside microddp's own
and says what is wrong: which rank, which case, expected against got.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import MicroDDPError

EPILOG = """examples:
  microddp exercise list
  microddp exercise start ring --out mywork   # writes mywork/ring_all_reduce.py
  microddp exercise check ring mywork/ring_all_reduce.py
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`list`, `start NAME [--out DIR]`, `check NAME FILE`."""
    p.add_argument("action", choices=("list", "start", "check"), help="what to do")
    p.add_argument("name", nargs="?", help="the exercise (see `microddp exercise list`)")
    p.add_argument("file", nargs="?", help="check: your file")
    p.add_argument("--out", default=".", help="start: the folder to write FUNCTION.py into "
                   "(default: the current folder)")
    p.add_argument("--force", action="store_true", help="start: overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    """Do the action; exit 0 when a check passes, 1 when it finds a problem."""
    from ..exercises import EXERCISES

    if args.action == "list":
        print(f"{'name':7} {'chapter':8} exercise")
        for e in EXERCISES.values():
            print(f"{e.name:7} {e.chapter:8} {e.title} (write {e.function}())")
        return 0
    if args.name not in EXERCISES:
        raise MicroDDPError(f"{'no exercise named ' + repr(args.name) if args.name else 'name an exercise'}"
                            f"; choose one of {', '.join(EXERCISES)}")
    e = EXERCISES[args.name]
    if args.action == "start":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        to = Path(args.out) / f"{e.function}.py"
        if to.exists() and not args.force:
            raise MicroDDPError(f"{to} exists; check it with `microddp exercise check {e.name} "
                                f"{to}`, or pass --force to start over")
        to.write_text(e.starter)
        print(f"wrote {to}: write {e.function}() there, then run "
              f"`microddp exercise check {e.name} {to}`")
        return 0
    if not args.file:
        raise MicroDDPError(f"check needs your file: microddp exercise check {e.name} "
                            f"{e.function}.py")
    print(f"checking {e.function}() in {args.file} (chapter {e.chapter}: {e.title}) ...",
          flush=True)
    problems = e.check(args.file)
    if problems:
        for line in problems:
            print(f"not yet: {line}", file=sys.stderr)
        return 1
    print(f"solved: {e.function}() gives microddp's answers in every case")
    return 0
