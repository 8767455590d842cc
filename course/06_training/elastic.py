"""Chapter 6, script 6: lose a rank in the middle of training, two ways.

    python course/06_training/elastic.py

The same job (4 ranks, the same seed and global batches) loses a rank to SIGKILL after its
step 8, twice:

- with `--max-restarts 1`, the launcher stops every rank and starts them all again; they
  resume from the last checkpoint (every 6 steps here), so the steps after it run twice;
- with `--elastic`, the three survivors form a new group among themselves within a second and
  run the failed step again, each taking a third of the lost rank's share of every batch.

Both end at the same weights as an uninterrupted run, within float rounding. The script prints
the loss the elastic run logged, who trained each step, and what each way cost.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

JOB = ["--nproc", "4", "--epochs", "2", "--hidden", "32", "--depth", "1", "--batch-size",
       "128", "--log-every", "2", "--no-plot"]
KILL_AFTER = 8  # the rank dies in the step after this one


def train(out: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "microddp", "train", *JOB, "--out",
                             str(out), *flags], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def worker_pid(out: Path, rank: int) -> int | None:
    """The pid of the worker with RANK=`rank` of the job writing to `out` (Linux /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"microddp.train" in cmd and str(out).encode() in cmd and \
                f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


def restart_way(out: Path) -> tuple[float, int]:
    """--max-restarts: kill rank 1 once step KILL_AFTER is logged; every rank restarts."""
    t0 = time.perf_counter()
    job = train(out, "--max-restarts", "1", "--checkpoint-every", "6")
    killed = False
    while job.poll() is None:
        if not killed and any(r.get("step", 0) >= KILL_AFTER for r in rows(out)):
            pid = worker_pid(out, 1)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.02)
    text = job.stdout.read()
    assert job.returncode == 0 and killed, text
    found = re.search(r"resuming from \S+: step (\d+)", text)
    resumed = int(found.group(1)) if found else 0
    return time.perf_counter() - t0, resumed


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain, elastic, restarted = (Path(tmp) / n for n in ("plain", "elastic", "restarted"))
        t0 = time.perf_counter()
        job = train(plain)
        assert job.wait() == 0, job.stdout.read()
        plain_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        # The lost rank SIGKILLs itself in the middle of its step KILL_AFTER + 1 (a hook the
        # tests use too: the same moment in every run of this script).
        job = train(elastic, "--elastic",
                    env={"MICRODDP_ELASTIC_FAULT": f"kill:1:{KILL_AFTER}"})
        text = job.communicate()[0]
        assert job.returncode == 0, text
        elastic_s = time.perf_counter() - t0
        print("elastic: the loss goes on while the group shrinks")
        print("  step  loss    ranks")
        for r in rows(elastic):
            if r["kind"] == "step":
                print(f"  {r['step']:4d}  {r['loss']:.4f}  {r['ranks']}")
        change = next(r for r in rows(elastic) if r["kind"] == "membership")
        print(f"lost id {change['lost']} in step {change['step']}; members now "
              f"{change['members']}; the step ran again {change['pause_s']:.2f} s after the "
              "failure was seen")
        who = {}
        for line in (elastic / "samples-2.jsonl").read_text().splitlines():
            r = json.loads(line)
            who[r["step"]] = len(r["members"])
        print(f"step {KILL_AFTER}: {who[KILL_AFTER]} ranks share the batch of 128; "
              f"step {KILL_AFTER + 1}: {who[KILL_AFTER + 1]} ranks share it")

        restart_s, resumed = restart_way(restarted)
        print(f"restart: every rank restarted, resumed from the checkpoint of step {resumed}, "
              f"so steps {resumed + 1}-{KILL_AFTER + 1} ran twice")

        ref = torch.load(plain / "model.pt")
        for name, out in (("elastic", elastic), ("restart", restarted)):
            got = torch.load(out / "model.pt")
            diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
            print(f"{name}: max |weight - uninterrupted run's| = {diff:.1e}")
        print(f"wall time: uninterrupted {plain_s:.1f} s, elastic {elastic_s:.1f} s, "
              f"restart {restart_s:.1f} s")


if __name__ == "__main__":
    main()
