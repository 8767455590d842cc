"""The code stays ruff-clean (configuration in pyproject.toml), enforced where CI looks."""

import re
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
    calls = [(path.relative_to(ROOT), call) for path in sorted((ROOT / "course").rglob("*.py"))
             for call in re.findall(r"mdp\.spawn\((?:[^()]|\([^()]*\))*\)",
                                    path.read_text())]
    assert len(calls) >= 20  # the pattern still finds them
    unnamed = [f"{path}: {call}" for path, call in calls if "backend=" not in call]
    assert not unnamed, "\n".join(unnamed)
