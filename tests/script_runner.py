"""Running a course script as a learner does, `python course/.../x.py ARGS`, for the chapter tests
(not a test module itself).

A script run in a fresh interpreter pays for `import torch` twice before it does anything: once
in its own process and once in the forkserver its ranks fork from (2-3 s on an idle core of
this machine, up to 10 s under load). The chapter tests run some 70 scripts, so by default a
script runs here, inside the test's own process, as `runpy` runs it under `python x.py`: its
folder first on sys.path, `__name__ == "__main__"`, sys.argv as typed, its exit status from
SystemExit (as the OS reports it: 0-255), warnings printed to its stderr, its output and its
ranks' output captured at the file descriptors. Its ranks then fork from this process's
forkserver, which has torch (and torch._dynamo, see conftest.py) loaded already. Undone
afterwards: the modules the script imported from its own folder (chapters 5, 8, 9 and 10 each
have a `problem.py`), os.environ, the working directory, sys.path and sys.argv.

What is NOT fresh in-process, so what these runs cannot catch: modules other tests imported
stay imported, with their state (a script that forgets an import another module made still
runs); the forkserver's own standard error is whatever this process's was when it started, so
a rank that fails while importing the script before its set-up prints there (`output()` then
runs the script again in a fresh interpreter to show the error); and `timeout` is only
enforced in a fresh interpreter (in-process, spawn's deadline and pytest-timeout's apply).
CI runs the chapter tests once more with MICRODDP_TEST_SCRIPTS=subprocess, every script in a
fresh interpreter, exactly as typed. A run with environment variables of its own always goes
to a fresh interpreter: modules read the environment once (tempfile caches TMPDIR), so setting
it in this process would not be what the script sees when a learner sets it.
"""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    """What subprocess.run returns, the fields the tests read."""

    returncode: int
    stdout: str
    stderr: str


def run_script(script: str | Path, *args: str, cwd: str | Path = ROOT, env: dict | None = None,
               timeout: float = 240, fresh: bool = False) -> Done:
    """Run `python script ARGS` in `cwd` with `env` added to the environment; return its exit
    status and output. In this process unless `fresh` or `env` (module docstring)."""
    script = Path(script).resolve()
    if fresh or env or os.environ.get("MICRODDP_TEST_SCRIPTS") == "subprocess":
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                              text=True, timeout=timeout, cwd=cwd,
                              env={**os.environ, **(env or {})})
        return Done(done.returncode, done.stdout, done.stderr)
    return _in_process(script, list(args), Path(cwd))


def _in_process(script: Path, args: list[str], cwd: Path) -> Done:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    saved_modules = set(sys.modules)
    folder, shadowed = str(script.parent), {}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = _Redirect(out, err)
        code = 1
        try:
            os.chdir(cwd)
            sys.path[:] = [folder, *saved_path]
            sys.argv[:] = [str(script), *args]
            # a module of the same name as one in the script's folder (another chapter's
            # problem.py a test imported) would be found first: set it aside for the run
            shadowed = {p.stem: sys.modules.pop(p.stem) for p in script.parent.glob("*.py")
                        if p.stem in sys.modules}
            with streams:
                code = _exit_code(script)
        finally:
            sys.argv[:] = saved_argv
            sys.path[:] = saved_path
            os.chdir(saved_cwd)
            _restore_environ(saved_env)
            _forget_from(folder, saved_modules)
            sys.modules.update(shadowed)
        return Done(code, streams.read(out), streams.read(err))


def _exit_code(script: Path) -> int:
    """Run the script as `python` would and return the exit status it would have."""
    with warnings.catch_warnings():
        warnings.resetwarnings()  # the interpreter's defaults, not pytest's recording
        warnings.simplefilter("default")
        warnings.showwarning = _show_warning
        try:
            runpy.run_path(str(script), run_name="__main__")
            return 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                return (e.code or 0) & 0xFF  # as the OS reports it: sys.exit(-1) is 255
            print(e.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
            return 1
        except Exception:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            return 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _restore_environ(saved: dict) -> None:
    """Put os.environ back key by key (never empty, even for a moment: threads read it)."""
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _forget_from(folder: str, keep: set[str]) -> None:
    """Drop the modules imported since `keep` that live in `folder`."""
    for name in set(sys.modules) - keep:
        path = getattr(sys.modules[name], "__file__", None) or ""
        if os.path.dirname(os.path.abspath(path)) == folder:
            del sys.modules[name]


class _Redirect:
    """File descriptors 1 and 2, and sys.stdout/err, pointed at two files for a while: the ranks
    get duplicates of this process's descriptors 1 and 2, so Python-level capture alone would
    miss what they print."""

    def __init__(self, out, err):
        self.files = (out, err)

    def __enter__(self):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.saved_fds = [os.dup(1), os.dup(2)]
        self.saved_streams = (sys.stdout, sys.stderr)
        for fd, f in zip((1, 2), self.files, strict=True):
            os.dup2(f.fileno(), fd)
        # line-buffered, as on a terminal; written through to the descriptors above
        sys.stdout = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb"), line_buffering=True)
        return self

    def __exit__(self, *exc):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = self.saved_streams
        for fd, saved in zip((1, 2), self.saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)

    @staticmethod
    def read(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


def output(script: str | Path, *args: str, **env: str) -> str:
    """The script's standard output, after checking that it exited 0 (else its output is the
    failure's message)."""
    done = run_script(script, *args, env=env)
    if done.returncode != 0 and not env:
        # in-process, a rank that failed before its set-up printed where the forkserver's
        # standard error goes, not here: a fresh run shows it (and fails the test all the same)
        again = run_script(script, *args, fresh=True)
        done.stderr += (f"\n--- the same script in a fresh interpreter: exit {again.returncode}\n"
                        + again.stdout + again.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout
