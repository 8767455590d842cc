"""`import microddp`, every `--help`, an argument error and the `microddp run` launcher's
start need no torch: each `microddp` invocation would otherwise pay a full `import torch`
(1.5 s on an idle 2-core machine, several under load) before it does anything.

Each check runs in a fresh interpreter: in this one, other tests have imported torch already.
The public names still work after the lazy import: tests/test_public_names.py checks every
name the docs use, and test_the_public_names_are_comms_whichever_way_comms_is_imported that
microddp.init is comms' (which sets up the hang monitor and the shared-memory route).
"""

import subprocess
import sys

import pytest

from launch_helpers import microddp

# Prints what torch would have cost: a module list, empty when torch was never imported.
_REPORT = "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"


def _torch_modules(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\n{_REPORT}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_import_microddp_imports_no_torch():
    assert _torch_modules("import microddp") == "[]"


# microddp.commands.main as the `microddp` script calls it; --help and argparse's errors end
# in SystemExit (0 and 2), which the snippet checks so that a crash cannot pass for help.
_MAIN = """
import contextlib, io
from microddp.commands import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = main({argv!r})
    except SystemExit as e:
        code = e.code
assert code == {code}, (code, out.getvalue())
assert {text!r} in out.getvalue(), out.getvalue()
"""

HELP = [[], ["run"], ["hello"], ["doctor"], ["bench"], ["train"]]


@pytest.mark.parametrize("path", HELP, ids=lambda p: " ".join(["microddp", *p]))
def test_help_imports_no_torch(path):
    code = _MAIN.format(argv=[*path, "--help"], code=0,
                        text=f"usage: {' '.join(['microddp', *path])}")
    assert _torch_modules(code) == "[]"


@pytest.mark.parametrize("argv", [["run", "-n", "two", "x.py"], ["run", "--nosuch", "x.py"],
                                  ["nosuch"]], ids=" ".join)
def test_an_argument_error_imports_no_torch(argv):
    assert _torch_modules(_MAIN.format(argv=argv, code=2, text="error:")) == "[]"


def test_the_launchers_modules_import_no_torch_before_its_store():
    # `microddp run`'s parent hosts the workers' store (procs.AgentStore.start imports it, and
    # torch with comms): the rest is torch-free.
    code = ("from microddp.commands import run\n"
            "from microddp.launch import run as launch_run, hosts, procs\n"
            "env = procs.worker_env({}, 0, 2, procs.AgentStore(None, '127.0.0.1', 1, 's' * 32), "
            "run_id=procs.new_run_id())\n"
            "assert env['MASTER_PORT'] == '1'\n")
    assert _torch_modules(code) == "[]"


def test_the_public_names_are_comms_whichever_way_comms_is_imported():
    # mdp.init is comms.init (world, shared memory, hang monitor), whichever way it is reached.
    code = ("from microddp.comms import init\n"
            "from microddp.comms import session\n"
            "from microddp.world import world\n"
            "import microddp\n"
            "assert microddp.init is init is session.init\n"
            "assert microddp.World is world.World\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_launcher_still_runs_its_workers():
    # What the launcher no longer imports up front, it still imports where it needs it.
    out = microddp("run", "-n", "2", "-m", "microddp.commands.hello")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("all_reduce(sum of ranks) = 1 (expected 1)") == 2, out.stdout
