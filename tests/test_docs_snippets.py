"""Every python and bash block in README.md and docs/*.md runs as written, or says why not.

Conventions (docs/architecture.md, "Code blocks in these pages"):
- an HTML comment right before the fence, `<!-- fragment: why -->`, marks a block that is not
  a whole program; `<!-- not run by the tests: why -->` marks whole commands left out here:
  installing packages and running the whole suite (the README's set-up lines: this test runs
  inside that suite), two hosts under torchrun, benchmarks and the default training job that
  take minutes (tests/test_train_cli.py runs the job itself). Their microddp lines must still
  parse and name files that exist.
- a block that includes a file with `--8<--` is a course script, run by its chapter's test;
  a block without a language is output or a diagram.
Everything else runs in a fresh temporary folder holding a copy of course/, each block under
a deadline, so nothing it writes stays behind.
"""

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_examples import ROOT, RUN_DEADLINE, check_parses, command_lines, run_command

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # guides/ too
# A fence may be indented (inside a tab or an admonition); its body is read dedented.
FENCE = re.compile(r"(?:<!--\s*(?P<mark>[^>]*?)\s*-->\s*\n)?^(?P<indent>[ \t]*)```(?P<lang>\w*)"
                   r"[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
MARKS = ("fragment:", "not run by the tests:")


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text[:m.start("lang")].count("\n") + 1
            yield (f"{page.relative_to(ROOT)}:{line}", m.group("lang"), m.group("mark"),
                   textwrap.dedent(m.group("body")))


BLOCKS = [b for b in _blocks() if b[1] in ("python", "bash") and "--8<--" not in b[3]]
RUNNABLE = [b for b in BLOCKS if b[2] is None]
MARKED = [b for b in BLOCKS if b[2] is not None]


def test_the_pages_have_blocks_of_each_kind():
    assert len(RUNNABLE) >= 8 and len(MARKED) >= 8  # the pattern finds them at all


@pytest.mark.parametrize("where,lang,mark,body", MARKED, ids=[b[0] for b in MARKED])
def test_a_marked_block_says_why_and_its_commands_parse(where, lang, mark, body):
    assert mark.startswith(MARKS) and len(mark.split(":", 1)[1].strip()) > 5, \
        f"{where}: mark a block with <!-- fragment: why --> or <!-- not run by the tests: why -->"
    if mark.startswith("not run") and lang == "bash":
        made: set[Path] = set()  # as for an unmarked block: a file an earlier line writes
        for line in command_lines(body):
            if line.split()[0] != "python" or "course/" in line:
                check_parses(line, made)
            words = line.split()
            if "--out" in words:
                made.add(Path(words[words.index("--out") + 1]))


@pytest.mark.parametrize("where,lang,mark,body", [b for b in RUNNABLE if b[1] == "bash"],
                         ids=[b[0] for b in RUNNABLE if b[1] == "bash"])
def test_an_unmarked_blocks_commands_parse(where, lang, mark, body):
    """What the default set checks of the blocks the slow set runs: each line parses, and every
    file it reads exists in a clone or in a folder an earlier line writes (--out)."""
    made: set[Path] = set()
    for line in command_lines(body):
        check_parses(line, made)
        words = line.split()
        if "--out" in words:
            made.add(Path(words[words.index("--out") + 1]))


@pytest.fixture
def clone(tmp_path):
    """An empty working folder with the course scripts, as a fresh clone has them."""
    shutil.copytree(ROOT / "course", tmp_path / "course",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.slow  # every docs block as written: ~30 whole commands end to end, for CI's slow run (the parse check of marked blocks stays in the default set)
@pytest.mark.parametrize("where,lang,mark,body", RUNNABLE, ids=[b[0] for b in RUNNABLE])
def test_an_unmarked_block_runs_as_written(where, lang, mark, body, clone):
    if lang == "python":
        (clone / "snippet.py").write_text(body)
        out = subprocess.run([sys.executable, "snippet.py"], cwd=clone, capture_output=True,
                             text=True, timeout=RUN_DEADLINE)
        assert out.returncode == 0, f"{where}:\n{out.stdout}\n{out.stderr}"
        return
    lines = command_lines(body)
    others = [raw for raw in body.splitlines() if raw.strip() and not raw.startswith(" ")
              and raw.split()[0] not in ("microddp", "python")]
    assert lines and not others, f"{where}: only microddp and python course/ commands run " \
        f"here; mark the block otherwise ({others})"
    for line in lines:
        words = line.split()
        assert words[0] == "microddp" or words[1].startswith("course/"), f"{where}: {line}"
        run_command(line, clone)
