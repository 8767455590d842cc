"""The home page's learner's path stays true: its table lists every chapter page once, in
course order, each exercise beside the chapter it belongs to, and its reading times are the
pages' prose at the rate it states (docs/measured/time_chapters.py counts both)."""

import importlib.util
import re
from pathlib import Path

from microddp.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _timer():
    spec = importlib.util.spec_from_file_location("time_chapters",
                                                  DOCS / "measured" / "time_chapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _path_rows() -> list[list[str]]:
    text = DOCS.joinpath("index.md").read_text()
    section = text.split("## A learner's path", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[1:]]


def test_the_path_lists_every_chapter_once_in_order_with_its_exercise():
    rows = _path_rows()
    pages = [re.search(r"\]\(([^)]+\.md)\)", r[1])[1] for r in rows]
    chapters = sorted(p.name for p in DOCS.glob("[0-9][0-9]*-*.md") if "notebook" not in p.name
                      and not p.name.startswith("04c"))  # 4c: an optional page, named below it
    assert pages == chapters
    exercises = {re.sub(r"`", "", r[5]): r[0] for r in rows if r[5]}
    assert exercises == {e.name: e.chapter for e in EXERCISES.values()}


def test_reading_times_are_the_pages_prose_at_the_stated_rate():
    timer = _timer()
    for row in _path_rows():
        page = DOCS / re.search(r"\]\(([^)]+\.md)\)", row[1])[1]
        words = timer.prose_words(page)
        assert row[3] == f"{max(1, round(words / timer.WORDS_PER_MINUTE))} min", page.name
    assert f"at {timer.WORDS_PER_MINUTE} words a" in DOCS.joinpath("index.md").read_text()


def test_prose_words_leave_out_code_comments_and_included_files(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("one two\n```python\nx = 1 2 3\n```\n<!-- a b c -->\n--8<-- \"f.py\"\nthree\n")
    assert _timer().prose_words(page) == 3
