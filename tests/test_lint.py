"""The code stays ruff-clean (configuration in pyproject.toml), enforced where CI looks."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "course"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_course_scripts_name_their_backend():
    # Their tensors are on the CPU: on a host with a GPU per rank the default backend is NCCL,
    # which moves CUDA tensors only, and the script would fail there.
    calls = [(path.relative_to(ROOT), node.lineno)
             for path in sorted((ROOT / "course").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "spawn" and getattr(node.func.value, "id", "") == "mdp"
             and not {"backend", "join"} & {k.arg for k in node.keywords}]
    # (join=False: spawn forms no group, the ranks call init_process_group with a backend)
    assert not calls, f"mdp.spawn without backend= at {calls}"
