"""`import torch` registers the "microddp" backend through torch's plugin entry points (issue
50): torch 2.13 loads every `torch.backends` entry point at the end of `import torch`.

The entry point is declared in pyproject.toml; an installed microddp carries it in its
dist-info. So that this test does not depend on how microddp was installed here, it puts a
dist-info holding the same entry point on the path of a fresh interpreter, which then runs a
one-rank `init_process_group("microddp")` without importing microddp. Without it, or with
torch's autoloading off, the script fails with torch's "Unknown backend type", and microddp's
doctor and messages say the import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
import torch
import torch.distributed as dist
print("before init:", "microddp.backend" in sys.modules,
      "microddp.backend.process_group" in sys.modules)
try:
    dist.init_process_group("microddp", store=dist.HashStore(), rank=0, world_size=1)
except Exception as e:
    print("error:", type(e).__name__, str(e).splitlines()[0])
    raise SystemExit(0)
t = torch.ones(3)
dist.all_reduce(t)
print("group:", type(dist.group.WORLD).__name__, t.tolist())
dist.destroy_process_group()
"""


def entry_point() -> str:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return spec["project"]["entry-points"]["torch.backends"]["microddp"]


def run(tmp_path, with_entry_point: bool, autoload: str = "1") -> str:
    site = tmp_path / "site"
    if with_entry_point:
        info = site / "microddp_autoload_check-0.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: microddp-autoload-check\n"
                                       "Version: 0.0\n")
        (info / "entry_points.txt").write_text(f"[torch.backends]\nmicroddp = {entry_point()}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]),
               TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_entry_point_registers_the_backend_at_import_torch(tmp_path):
    assert entry_point() == "microddp.backend:autoload"
    out = run(tmp_path, with_entry_point=True)
    assert "group: MicroDDPProcessGroup [1.0, 1.0, 1.0]" in out, out
    # the entry point registered the name only: the group class came with the first group
    assert "before init: True False" in out


def test_microddps_messages_say_the_import_where_torch_says_unknown_backend():
    from microddp.backend import IMPORT_HINT
    from microddp.launch.run import HINTS
    assert HINTS["Unknown backend type microddp"] == IMPORT_HINT
    assert "`import microddp.backend`" in IMPORT_HINT


# Two more fresh interpreters, each `import torch` (seconds each on a loaded machine): slow.
@pytest.mark.slow
def test_without_it_torch_says_unknown_backend_and_the_doctor_sees_it(tmp_path):
    out = run(tmp_path, with_entry_point=True, autoload="0")  # torch's switch: autoloading off
    assert "Unknown backend type microddp" in out, out
    from microddp.launch.doctor import backend_autoloads
    # this environment, as the doctor sees it: autoloaded exactly when installed with it
    installed = "microddp" in _installed_points()
    assert backend_autoloads() == (installed and os.environ.get(
        "TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1")


def _installed_points() -> list[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="torch.backends")]
