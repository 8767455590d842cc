"""The docs site builds strictly (no dead links, every included script exists) and every
course script is included by its chapter page rather than pasted."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _nav_pages() -> list[str]:
    # mkdocs.yml has no custom tags, so a plain YAML load reads it.
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [next(iter(item.values())) for item in config["nav"]]


def test_every_nav_page_exists():
    missing = [p for p in _nav_pages() if not (ROOT / "docs" / p).is_file()]
    assert missing == []


def test_mkdocs_build_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "01-first-program" / "index.html").is_file()


def test_every_course_script_is_included_by_a_page():
    included = set()
    for page in (ROOT / "docs").glob("*.md"):
        included |= set(re.findall(r'--8<-- "([^"]+)"', page.read_text()))
    scripts = {str(p.relative_to(ROOT)) for p in (ROOT / "course").rglob("*.py")
               if not p.name.startswith("_")}
    assert scripts - included == set()
