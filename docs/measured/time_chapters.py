"""Time every course script as a learner runs it: `python course/NN_topic/x.py` in a fresh
interpreter, one after the other, from the repository root, with the arguments its chapter
page gives (none for most). Prints one line per script and a total per chapter, and writes
them as JSON, which docs/index.md's reading times quote.

    python docs/measured/time_chapters.py                   # every chapter
    python docs/measured/time_chapters.py 05 08 --out t.json
    python docs/measured/time_chapters.py --table t.json     # the rows docs/index.md quotes

Wall-clock seconds depend on what else the machine runs, so each line also gives the load
average when the script started: on a shared machine the times are an upper bound. (CPU time
is not reported: a script's ranks are children of multiprocessing's forkserver, which the
script never waits for, so the OS does not add their CPU time to the script's.) A script
that fails is reported and counted.
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


WORDS_PER_MINUTE = 200  # reading technical prose; code and output are read as they run


def prose_words(page: Path) -> int:
    """Words of a page outside code blocks, included files and HTML comments."""
    words, fenced = 0, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith(("<!--", "--8<--")):
            continue
        words += len(line.split())
    return words


def table(times: dict) -> str:
    """Markdown rows: per chapter, its pages' prose words and reading minutes, and its
    scripts' seconds from a --out file, with the load they ran under."""
    rows = ["| chapter | prose words | reading | scripts | load average |",
            "|---|---|---|---|---|"]
    for folder, t in sorted(times.items()):
        number = folder.split("_")[0]
        pages = sorted((ROOT / "docs").glob(f"{number}-*.md"))
        words = sum(prose_words(pg) for pg in pages)
        loads = [s["load_average"] for s in t["scripts"].values()]
        rows.append(f"| {folder} | {words} | {words / WORDS_PER_MINUTE:.0f} min | "
                    f"{t['seconds']:.0f} s | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapters", nargs="*", help="chapter prefixes (default: all), e.g. 05 08")
    p.add_argument("--out", type=Path, help="write the times as JSON here")
    p.add_argument("--table", type=Path, help="print the rows of a --out file and stop")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
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
