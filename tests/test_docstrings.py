"""Every public name has a docstring: the API reference (docs/hooks/site.py, mkdocstrings)
renders them, so a name without one is a blank entry there.

Public: a module none of whose dotted parts starts with an underscore (`__init__` aside), and
in it every function and class whose name does not, and every such method of such a class.
Read from the source (no import), so the check is quick and sees exactly what the docs see.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "microddp"
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def public_modules() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__main__" or any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        out.append(path)
    return out


def public_names(tree: ast.Module, prefix: str = "") -> list[ast.AST]:
    """(qualified name, node) of the public functions and classes in `tree`, methods included."""
    found = []
    for node in tree.body:
        if isinstance(node, DEFS) and not node.name.startswith("_"):
            found.append((prefix + node.name, node))
            if isinstance(node, ast.ClassDef):
                found += public_names(node, f"{prefix}{node.name}.")
    return found


def test_the_scan_sees_the_package():
    # If the walk found nothing it would check nothing: the names every user meets are there.
    names = {f"{p.stem}.{q}" for p in public_modules() for q, _ in public_names(ast.parse(
        p.read_text()))}
    assert {"ddp.DistributedDataParallel", "world.init", "ring.ring_all_reduce"} <= names
    assert len(names) > 400


def test_every_public_module_has_a_docstring():
    bare = [str(p.relative_to(ROOT)) for p in public_modules()
            if not ast.get_docstring(ast.parse(p.read_text()))]
    assert bare == [], f"public modules without a docstring: {bare}"


def test_every_public_function_class_and_method_has_a_docstring():
    bare = []
    for path in public_modules():
        for name, node in public_names(ast.parse(path.read_text())):
            if not ast.get_docstring(node):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert bare == [], ("public names without a docstring (say what it does and why, in a "
                        "line): " + "\n".join(bare))
