"""The layout is the architecture: folders in layers, each importing only the layers below it.

Parses every module with ast (no import, so a cycle cannot hide behind a lazy import or
TYPE_CHECKING) and checks: no import cycle between microddp modules; a folder imports only
the layers below it (LAYERS, the one place the order is written); no module outside a package
imports its underscore modules; at most 10 flat modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top; a name is a folder or a flat module of src/microddp. A row may import its
# own row (no cycle: test_no_import_cycle) and the rows below it, never a row above.
# docs/architecture.md draws this picture.
LAYERS = [
    ("errors", "outputs", "model", "spans", "timing"),   # shared by everything
    ("gpt",),                  # the transformer and its text (no distributed code)
    ("world",),                # bootstrap: the process group, rendezvous, hosts, the store
    ("transport",),            # how two ranks move bytes
    ("shm",),                  # same-host shared memory: segment, attach, group, lane, agreement
    ("collectives",),          # algorithms over transport
    ("backend",),              # torch.distributed's "microddp" backend over the collectives
    ("monitor",),              # hang and desync reports over the world and collectives
    ("comms",),                # the typed API over collectives and monitor: ops, handle, mesh
    ("dp", "pipeline", "zero", "ps", "tp", "data", "checkpoint"),  # parallelism; what a job reads, keeps
    ("flags",),                # command-line checks (engine names come from dp)
    ("launch",),               # starting ranks
    ("trace",),                # traced runs of the engines
    ("train", "predict", "bench", "exercises"),
    ("commands",),             # one thin file per verb
    ("__init__", "__main__"),  # the public face
]
# Known exceptions, to remove, not to add to (none left).
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "microddp").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(name: str, path: Path) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.startswith("microddp")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("microddp"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    found.add(full if full in MODULES else _resolve(base))
        elif isinstance(node, ast.Constant) and str(node.value).startswith("microddp.") \
                and node.value in MODULES:
            found.add(node.value)  # import_module("microddp.x"): a dependency all the same
    found.discard(name)
    found.discard("")
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [])


def test_every_room_is_in_the_layers():
    rooms = {_room(m) for m in MODULES}
    named = {r for row in LAYERS for r in row}
    assert rooms == named, (rooms - named, named - rooms)


def test_a_layer_imports_only_the_layers_below_it():
    level = {r: i for i, row in enumerate(LAYERS) for r in row}
    wrong = sorted((m, d) for m, deps in GRAPH.items() for d in deps
                   if _room(m) != _room(d) and level[_room(d)] > level[_room(m)]
                   and (m, _room(d)) not in ALLOWED)
    assert not wrong, wrong


def test_underscore_modules_stay_in_their_package():
    root = SRC.parent
    files = [*(root / "src").rglob("*.py"), *(root / "tests").rglob("*.py"),
             *(root / "course").rglob("*.py")]
    wrong = []
    for p in files:
        text = p.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module + "." + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for full in names:
                parts = full.split(".")
                if not parts[0] == "microddp":
                    continue
                for i, part in enumerate(parts):
                    module = ".".join(parts[:i + 1])
                    if part.startswith("_") and not part.startswith("__") and module in MODULES:
                        owner = SRC / Path(*parts[:i])
                        if owner not in p.parents:
                            wrong.append((str(p.relative_to(root)), full))
                        break
    assert not wrong, wrong


def test_at_most_ten_flat_modules():
    flat = sorted(p.name for p in (SRC / "microddp").glob("*.py"))
    assert len(flat) <= 10, flat
