"""Time every course script as a learner runs it: `python course/NN_topic/x.py` in a fresh
interpreter, one after the other, from the repository root, with the arguments its chapter
page gives (none for most). Prints one line per script and a total per chapter, and writes
them as JSON, which docs/index.md's reading times quote.

    python docs/measured/time_chapters.py                   # every chapter
    python docs/measured/time_chapters.py 05 08 --out t.json

Wall-clock seconds on a shared machine: the load average is printed beside each run, so a
reader can tell an idle run from a crowded one. A script that fails is reported and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# scripts that need arguments: the ones their chapter page runs them with
ARGS = {"07_observability/flight_recorder.py": ["skip", "{tmp}/fr-skip"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapters", nargs="*", help="chapter prefixes (default: all), e.g. 05 08")
    p.add_argument("--out", type=Path, help="write the times as JSON here")
    args = p.parse_args(argv)
    folders = sorted(d for d in (ROOT / "course").iterdir() if d.is_dir()
                     and (not args.chapters or d.name.split("_")[0] in args.chapters))
    result: dict[str, dict] = {}
    for folder in folders:
        total, scripts = 0.0, {}
        for script in sorted(folder.glob("*.py")):
            if script.name.startswith("_") or script.name == "problem.py":
                continue  # problem.py is a chapter's shared module, not a script to run
            rel = f"{folder.name}/{script.name}"
            with tempfile.TemporaryDirectory() as tmp:
                extra = [a.format(tmp=tmp) for a in ARGS.get(rel, [])]
                load = os.getloadavg()[0]
                start = time.perf_counter()
                done = subprocess.run([sys.executable, str(script), *extra], cwd=ROOT,
                                      capture_output=True, text=True, timeout=900)
                took = time.perf_counter() - start
            total += took
            scripts[script.name] = {"seconds": round(took, 1), "returncode": done.returncode,
                                    "load_average": round(load, 1)}
            print(f"{rel:50s} {took:7.1f} s  exit {done.returncode}  load {load:.1f}",
                  flush=True)
        result[folder.name] = {"seconds": round(total, 1), "scripts": scripts}
        print(f"{folder.name:50s} {total:7.1f} s in all", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
