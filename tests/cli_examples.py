"""Command lines shown to users (in --help epilogs and in the docs), taken apart so a test can
check them: they parse, the files they name exist, and the quick ones run."""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys
from pathlib import Path

from microddp import commands as cli

ROOT = Path(__file__).resolve().parents[1]
RUN_DEADLINE = 240  # seconds per command: generous for a busy 2-core machine


def command_lines(text: str) -> list[str]:
    """The commands in `text`: lines starting with `microddp`, `torchrun` or `python` (after
    an optional `$ ` prompt), backslash continuations joined, `# comments` dropped."""
    lines, joined = [], ""
    for raw in text.splitlines():
        line = raw.strip().removeprefix("$ ")
        if joined:
            line = joined + " " + line
            joined = ""
        if line.endswith("\\"):
            joined = line[:-1].strip()
            continue
        if line.split()[:1] in (["microddp"], ["torchrun"], ["python"]):  # prose may hold a '
            lines.append(shlex.join(shlex.split(line, comments=True)))
    return lines


def parse_microddp(argv: list[str]) -> argparse.Namespace:
    """Parse `microddp ARGV` as the CLI does; a mistake fails the test instead of exiting."""
    parser = cli.build_parser(argv)
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:
        raise AssertionError(f"microddp {shlex.join(argv)} does not parse (exit {e.code})") from None
    assert not unknown, f"microddp {shlex.join(argv)}: unrecognized {unknown}"
    assert getattr(args, "_run", None), f"microddp {shlex.join(argv)} names no command"
    return args


def _module_parser(module: str) -> argparse.ArgumentParser:
    """The parser of a microddp module run with `-m` (the train and hello workers)."""
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=module, allow_abbrev=False)
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(parser)
    return parser


def check_parses(line: str, made: set[Path] = frozenset()) -> None:
    """`line` parses, and every script or file it reads exists in the repository (or in a
    folder `made` by an earlier command, e.g. a trace summarised after it was recorded)."""
    words = shlex.split(line)
    if words[0] == "microddp":
        parse_microddp(words[1:])
        rest = words[1:]
    else:  # torchrun ... [-m module | script.py] args, or python script.py args
        if "-m" in words:
            i = words.index("-m")
            module, rest = words[i + 1], words[i + 2:]
            assert module.startswith("microddp"), f"{line}: runs {module}, not microddp"
            _module_parser(module).parse_args(rest)
        else:
            rest = words[1:]
    for word in rest:
        if word.endswith((".py", ".json")):
            path = Path(word)
            assert (ROOT / path).is_file() or any(parent in made for parent in path.parents), \
                f"{line}: {word} does not exist in a fresh clone"


def out_folders(line: str) -> set[Path]:
    """The folder a command writes into, if it names one with --out."""
    words = shlex.split(line)
    return {Path(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--out"}


def run_command(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a `microddp ...` or `python course/...` command in `cwd` with a deadline."""
    words = shlex.split(line)
    if words[0] == "microddp":
        cmd = [sys.executable, "-m", "microddp", *words[1:]]
    else:
        cmd = [sys.executable, *words[1:]]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=RUN_DEADLINE)
    assert out.returncode == 0, f"{line}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out
