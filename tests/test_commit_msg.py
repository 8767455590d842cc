"""The commit-message rule (.githooks/commit-msg, which .ci/run also runs over the commits since
issue 45): a subject of at most 72 characters, then a blank line before any body. Checked on
messages written here and, through git itself, on a throwaway repository's commits."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def _hook():
    loader = importlib.machinery.SourceFileLoader("commit_msg", str(HOOK))
    spec = importlib.util.spec_from_loader("commit_msg", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_subjects_of_72_pass_and_73_fail():
    problems = _hook().problems
    assert problems("x" * 72) == []
    assert problems("x" * 72 + "\n\nWhy, with the numbers.\n") == []
    [long] = problems("x" * 73)
    assert "73 characters" in long
    [glued] = problems("Fix the ring\nbecause the body follows at once")
    assert "second line must be blank" in glued
    assert problems("\n\nbody only") == ["the subject (first line) is empty: say what changed"]


def test_as_a_hook_it_ignores_comments_and_the_verbose_diff(tmp_path):
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text("Short subject\n\nBody.\n# Please enter the commit message\n"
                   "# ------------------------ >8 ------------------------\n" + "y" * 200 + "\n")
    ok = subprocess.run([sys.executable, str(HOOK), str(msg)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    msg.write_text("z" * 80 + "\n")
    bad = subprocess.run([sys.executable, str(HOOK), str(msg)], capture_output=True, text=True)
    assert bad.returncode == 1 and "80 characters" in bad.stderr


def test_the_range_check_names_the_offending_commit_and_lets_merges_pass(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t",
                               "-c", "user.email=t@t", *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q", "-b", "main")
    git("commit", "-q", "--allow-empty", "-m", "Base")
    base = git("rev-parse", "HEAD")
    git("checkout", "-q", "-b", "side")
    git("commit", "-q", "--allow-empty", "-m", "Side change\n\nWhy.")
    git("checkout", "-q", "main")
    git("commit", "-q", "--allow-empty", "-m", "Main change")
    git("merge", "-q", "--no-ff", "--no-edit", "side")  # git's default "Merge branch 'side'"
    run = [sys.executable, str(HOOK), "--range", f"{base}..HEAD"]
    assert subprocess.run(run, cwd=tmp_path, capture_output=True).returncode == 0
    git("commit", "-q", "--allow-empty", "-m", "w" * 100)
    bad = git("rev-parse", "HEAD")
    out = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 and bad[:10] in out.stderr and "100 characters" in out.stderr
