""""Is this a world of one?" has one answer: `microddp.comms.distributed()` (with `group_size`
and `group_rank` beside it in world/world.py). Seven modules used to answer it themselves,
each slightly differently (some asked torch whether the group was still initialised, some
did not); this test parses every module with ast and fails if one starts again.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "microddp"

# Where the question may be asked of torch directly: the answer itself, and the code that
# forms, adopts and tears down the group (it must ask torch, since it runs before or after a
# World exists).
HOME = {"world/world.py", "world/teardown.py"}
# Known, justified exceptions. Add (path, what) with a reason, never silently.
# comms/session.py: comms' `distributed` forms the world through session.init (hang monitor,
# shared memory) when nothing has, then asks world.distributed: the same one answer.
JUSTIFIED: set[tuple[str, str]] = {("comms/session.py", "def distributed"),
                                   ("comms/session.py", ".distributed")}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _offences(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
                "distributed", "_distributed", "group_size", "_group_size", "_size"):
            found.add(f"def {node.name}")
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" \
                and _dotted(node.value) != "torch":
            found.add(".distributed")  # World.distributed read instead of asking comms
        elif isinstance(node, ast.Call) and _dotted(node.func) in (
                "dist.is_initialized", "torch.distributed.is_initialized"):
            found.add("dist.is_initialized()")
        elif isinstance(node, ast.IfExp) and isinstance(node.body, ast.Call) \
                and isinstance(node.orelse, ast.Constant) and (
                    _dotted(node.body.func).rpartition(".")[2], node.orelse.value) in (
                    ("get_world_size", 1), ("get_rank", 0)):
            found.add("get_world_size/get_rank(...) if ... else 1/0")  # use group_size/_rank
    return found


def test_one_answer_to_is_this_a_world_of_one():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in HOME:
            continue
        for what in sorted(_offences(ast.parse(path.read_text(), str(path)))):
            if (rel, what) not in JUSTIFIED:
                bad.append(f"{rel}: {what}")
    assert not bad, ("ask microddp.comms (distributed, group_size, group_rank) instead:\n"
                     + "\n".join(bad))


def test_the_checker_sees_each_kind():
    src = """
def distributed(): pass
x = world.distributed
y = torch.distributed.all_reduce
dist.is_initialized()
torch.cuda.is_initialized()
n = dist.get_world_size(g) if on else 1
"""
    assert _offences(ast.parse(src)) == {
        "def distributed", ".distributed", "dist.is_initialized()",
        "get_world_size/get_rank(...) if ... else 1/0"}
