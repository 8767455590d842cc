"""The docs site builds strictly (no dead links, every included script exists), its generated
parts (navigation, API and CLI references, figure captions) hold what they must, and every
course script is included by its chapter page rather than pasted."""

import html
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from microddp.commands import all_parsers

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"


def _hooks():
    """docs/hooks/site.py, the code MkDocs runs to generate the site's parts."""
    spec = importlib.util.spec_from_file_location("docs_site_hooks", ROOT / "docs/hooks/site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_navigation_puts_every_page_in_its_section():
    hooks = _hooks()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    nav = hooks.navigation(pages, hooks.public_modules())
    sections = {next(iter(item)): next(iter(item.values())) for item in nav}
    assert list(sections) == ["Home", "Course", "Library", "Reference", "Lab notebook"]
    listed = ["index.md"] + [next(iter(e.values())) for key in ("Course", "Library", "Lab notebook")
                             for e in sections[key]]
    assert sorted(listed) == pages  # every page once: a new page needs no edit of mkdocs.yml
    course = [next(iter(e.values())) for e in sections["Course"]]
    assert course[:2] == ["01-first-program.md", "02-point-to-point.md"]
    assert "10-async.md" in course and "04b-ring-vs-gloo-notebook.md" not in course
    library = [next(iter(e.values())) for e in sections["Library"]]
    assert "architecture.md" in library and "guides/ddp.md" in library  # sub-folders too


def test_heading_ids_never_start_with_a_digit():
    slug = _hooks().slugify
    assert slug("1. Your first distributed program", "-") == "your-first-distributed-program"
    assert slug("4b. Lab notebook: our ring against gloo's", "-") == \
        "lab-notebook-our-ring-against-gloos"
    assert slug("2 ranks, one connection", "-") == "n-2-ranks-one-connection"
    assert slug("Script 1: ping-pong", "-") == "script-1-ping-pong"


def test_inline_code_wraps_between_its_words_only():
    """extra.css keeps inline code on one line (`--flops` whole); a whole command written
    inline must still wrap, at its spaces, or it runs past the text column."""
    words = _hooks().words_unbroken
    assert words("<p><code>--flops</code></p>") == "<p><code>--flops</code></p>"
    assert words("<p>run <code>microddp bench  ddp\n--dims 512</code>.</p>") == (
        '<p>run <code class="words"><span>microddp</span> <span>bench</span>  '
        '<span>ddp</span>\n<span>--dims</span> <span>512</span></code>.</p>')
    block = '<pre><span></span><code>microddp bench ddp</code></pre>'
    assert words(block + "<code>a b</code>") == block + (
        '<code class="words"><span>a</span> <span>b</span></code>')  # blocks left alone


def test_the_api_reference_covers_public_modules_only():
    modules = _hooks().public_modules()
    assert {"microddp", "microddp.world.world", "microddp.dp.ddp",
            "microddp.collectives.ring"} <= set(modules)
    assert not [m for m in modules if any(p.startswith("_") for p in m.split("."))]


@pytest.mark.slow  # the whole docs site built with mkdocs --strict
def test_mkdocs_build_strict_and_what_it_generates(tmp_path):
    """One build (a few seconds of the suite): strict, then each generated part checked."""
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                            "-d", str(site)], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (site / "01-first-program" / "index.html").is_file()
    assert "<loc>" in (site / "sitemap.xml").read_text()  # site_url is set
    _check_cli_reference(site)
    _check_api_reference(site)
    _check_figures(site)


def _check_cli_reference(site: Path) -> None:
    """Every command and every option of every command is on the CLI reference page."""
    page = html.unescape((site / "reference" / "cli" / "index.html").read_text())
    paths = list(all_parsers())
    assert len(paths) >= 10
    for path, parser in paths:
        assert f"microddp {' '.join(path)}".strip() in page
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in page, f"microddp {' '.join(path)} {flag} is not in the reference"


def _check_api_reference(site: Path) -> None:
    page = (site / "reference" / "api" / "microddp.dp.ddp" / "index.html").read_text()
    assert "DistributedDataParallel" in page and "no_sync" in page
    assert not list((site / "reference" / "api").glob("*._*"))  # no underscore module


def _check_figures(site: Path) -> None:
    """Each figure is small, on a page, and captioned with the command that made it."""
    made = json.loads((FIGURES / "figures.json").read_text())
    pngs = {p.stem for p in FIGURES.glob("*.png")}
    assert pngs == set(made) and len(pngs) >= 5
    shown = "".join(p.read_text() for p in site.rglob("*.html"))
    text = re.sub(r"<[^>]+>", "", shown)  # a caption's command is inline code, a span a word
    for name, how in made.items():
        assert (FIGURES / f"{name}.png").stat().st_size < 150_000, name
        assert how["command"] and how["machine"] and len(how["load_average"]) == 2
        assert f"figures/{name}.png" in shown, f"{name}.png is on no page"
        assert html.escape(how["command"], quote=False) in text, f"{name}: no caption"


def test_every_course_script_is_included_by_a_page():
    included = set()
    for page in (ROOT / "docs").glob("*.md"):
        included |= {re.sub(r"(\.py):\w+$", r"\1", p)
                     for p in re.findall(r'--8<-- "([^"]+)"', page.read_text())}
    scripts = {str(p.relative_to(ROOT)) for p in (ROOT / "course").rglob("*.py")
               if not p.name.startswith("_")}
    assert scripts - included == set()
