"""MkDocs hooks: the parts of the site that are generated, so they cannot drift from the code.

- the navigation, from the file names: `NN-*.md` is a course chapter, a `*notebook*` page is
  the lab notebook, any other page (in a sub-folder too) is a library guide; a new page
  appears without editing mkdocs.yml;
- the API reference: one page per public module of src/microddp (no underscore module), its
  content rendered by mkdocstrings from the docstrings;
- the CLI reference: one section per `microddp` command, made from its argparse parser
  (`microddp.commands.all_parsers`), so it shows what `--help` shows;
- heading ids that are valid CSS selectors (never starting with a digit: "1. The monolith"
  becomes `#the-monolith`), because scripts look headings up with `querySelector`;
- under every included course or library source, a link to that file in the repository;
- inline code that breaks only between its words: `--flops` stays whole, and a whole command
  written inline wraps at its spaces instead of running past the text column.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

from markdown.extensions import toc
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "microddp"
CHAPTER = re.compile(r"^\d\d[a-z]?-.*\.md$")
NUMBERED = re.compile(r"^\s*\d+[a-z]?\.\s+")
FIGURE = re.compile(r"^(?P<indent>[ \t]*)!\[[^\]]*\]\((?:\.\./)*figures/(?P<name>[\w-]+)\.png\)")
FIGURES = ROOT / "docs" / "figures" / "figures.json"
PRE = re.compile(r"(<pre[\s>].*?</pre>)", re.S)
INLINE_CODE = re.compile(r"<code>([^<]*\s[^<]*)</code>")
INCLUDE = re.compile(r'^(?P<indent>[ \t]*)--8<-- "(?P<path>(?:course|src)/[^":]+)(?::\w+)?"\s*$')


def slugify(value: str, separator: str) -> str:
    """A heading id without the chapter number, and never starting with a digit."""
    slug = toc.slugify(NUMBERED.sub("", value), separator)
    return f"n{separator}{slug}" if slug[:1].isdigit() else slug


def on_config(config):
    config.mdx_configs.setdefault("toc", {})["slugify"] = slugify
    return config


# --- the API reference ---------------------------------------------------------------------

def public_modules() -> list[str]:
    """Dotted names of every public module: no part starts with an underscore."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["microddp", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if not any(p.startswith("_") for p in parts):
            names.append(".".join(parts))
    return names


def _api_page(module: str) -> str:
    return f"::: {module}\n"


def _api_index(modules: list[str]) -> str:
    lines = ["# API reference", "",
             "Every public module of microddp, generated from its docstrings. Modules whose name",
             "starts with an underscore are private to their package and are left out; the",
             "`microddp` commands are in the [CLI reference](../cli.md).", ""]
    for module in modules:
        lines.append(f"- [`{module}`]({module}.md): {_first_line(module)}")
    return "\n".join(lines) + "\n"


def _first_line(module: str) -> str:
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


# --- the CLI reference ---------------------------------------------------------------------

def _cli_page() -> str:
    from microddp.commands import all_parsers

    lines = ["# CLI reference", "",
             "Every `microddp` command and option, generated from the command line's own",
             "argument parsers when this site was built: it says what `--help` says.", ""]
    for path, parser in all_parsers():
        lines += _cli_section(path, parser)
    return "\n".join(lines) + "\n"


def _cli_section(path: list[str], parser: argparse.ArgumentParser) -> list[str]:
    name = " ".join(["microddp", *path])
    out = [f"{'#' * min(len(path) + 1, 3) if path else '##'} `{name}`", ""]
    if parser.description:
        out += [_escape(parser.description.strip()), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    fmt = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            for sub in action._choices_actions:
                rows.append((f"`{sub.dest}`", sub.help or ""))
            continue
        flag = ", ".join(action.option_strings) or action.dest
        if action.option_strings and action.nargs != 0:
            flag += f" {fmt._format_args(action, fmt._get_default_metavar_for_optional(action))}"
        rows.append((f"`{flag}`", fmt._expand_help(action) if action.help else ""))
    if rows:
        out += ["| option | what it does |", "|---|---|"]
        out += [f"| {flag} | {_escape(text).replace(chr(10), ' ')} |" for flag, text in rows]
        out.append("")
    if parser.epilog:
        out += ["```text", parser.epilog.strip(), "```", ""]
    return out


def _escape(text: str) -> str:
    """Plain --help text as Markdown: pipes would split a table cell, `<` opens HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def figure_note(name: str, where: str) -> str:
    """The caption under a figure: the exact command, the machine, its load, the date."""
    made = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    if name not in made:
        raise PluginError(f"{where}: figures/{name}.png is not in docs/figures/figures.json; "
                          "make it with: python docs/figures/make.py")
    f = made[name]
    start, end = f["load_average"]
    return (f"Made by `{f['command']}` on {f['machine']}; load average {start} at the start, "
            f"{end} at the end; {f['date']}. Every figure: `python docs/figures/make.py`.")


# --- the files and the navigation ----------------------------------------------------------

def on_files(files: Files, config) -> Files:
    modules = public_modules()
    generated = {"reference/api/index.md": _api_index(modules),
                 "reference/cli.md": _cli_page()}
    generated |= {f"reference/api/{m}.md": _api_page(m) for m in modules}
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    config.nav = navigation([f.src_uri for f in files.documentation_pages()], modules)
    return files


def navigation(pages: list[str], modules: list[str]) -> list:
    """The site's sections from its page names: Course, Library, Reference, Lab notebook."""
    written = [p for p in pages if p != "index.md" and not p.startswith("reference/")]
    # the lab notebook and the measured pages: how figures were obtained, out of the course
    notebook = sorted(p for p in written if "notebook" in p or p.startswith("measured/"))
    course = sorted(p for p in written if CHAPTER.match(p) and p not in notebook)
    library = sorted(p for p in written if p not in course and p not in notebook)
    packages: dict[str, list] = {}
    for m in modules:
        parts = m.split(".")
        package = len(parts) > 1 and (PACKAGE / parts[1]).is_dir()
        group = ".".join(parts[:2]) if package else "microddp"
        packages.setdefault(group, []).append({m: f"reference/api/{m}.md"})
    api = [{"API": "reference/api/index.md"}] + [{g: items} for g, items in packages.items()]
    return [
        {"Home": "index.md"},
        {"Course": [_titled(p) for p in course]},
        {"Library": [_titled(p) for p in library]},
        {"Reference": [{"API": api}, {"CLI": "reference/cli.md"}]},
        {"Lab notebook": [_titled(p) for p in notebook]},
    ]


def _titled(page: str) -> dict[str, str]:
    for line in (ROOT / "docs" / page).read_text().splitlines():
        if line.startswith("# "):
            return {line[2:].strip().replace("`", ""): page}  # nav titles are plain text
    return {page.removesuffix(".md"): page}


# --- under each figure its command and machine; under each included file its source -------

def on_page_markdown(markdown: str, page, config, files) -> str:
    """After each figure, the line saying how it was made (docs/figures/figures.json); after
    each fenced block that includes a repository file, a link to that file."""
    repo = (config.repo_url or "").rstrip("/")
    out, pending = [], None
    for line in markdown.splitlines():
        out.append(line)
        figure = FIGURE.match(line)
        if figure:
            note = figure_note(figure["name"], page.file.src_uri)
            out += ["", figure["indent"] + note, figure["indent"] + "{: .figure-note }", ""]
        m = INCLUDE.match(line)
        if m and repo:
            pending = m
        elif pending and line.strip().startswith(("```", "~~~")):
            path, indent = pending["path"], pending["indent"]
            out += ["", f"{indent}[Source: `{path}`]({repo}/blob/main/{path}){{ .source-link }}",
                    ""]
            pending = None
    return "\n".join(out) + "\n"


# --- inline code: whole words, wrapped at spaces ------------------------------------------

def on_page_content(html: str, page, config, files) -> str:
    return words_unbroken(html)


def words_unbroken(html: str) -> str:
    """Inline code with spaces (a command, a signature) as one span per word: docs/assets/
    extra.css keeps each word on one line and lets the code wrap between them. Code blocks
    (inside <pre>) are left alone; the text, and so what a reader copies, is unchanged."""
    parts = PRE.split(html)
    for i in range(0, len(parts), 2):  # the even parts are outside <pre>
        parts[i] = INLINE_CODE.sub(_words, parts[i])
    return "".join(parts)


def _words(m: re.Match) -> str:
    words = re.split(r"(\s+)", m[1])
    spans = "".join(w if not w or w.isspace() else f"<span>{w}</span>" for w in words)
    return f'<code class="words">{spans}</code>'
