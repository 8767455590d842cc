"""Running under SLURM's `srun` without torchrun: rank, world size, local rank and the first
host from SLURM's variables, in the names torchrun uses.

    srun --nodes 2 --ntasks-per-node 4 python -m microddp.train      # no torchrun needed

`init()` calls `from_slurm()` when RANK is absent: SLURM_PROCID -> RANK, SLURM_NTASKS ->
WORLD_SIZE, SLURM_LOCALID -> LOCAL_RANK, this node's share of SLURM_TASKS_PER_NODE ->
LOCAL_WORLD_SIZE, the first node of SLURM_JOB_NODELIST -> MASTER_ADDR. MASTER_PORT is the
user's, or one derived from the job id, so every task of a job picks the same one.
"""

from __future__ import annotations

import itertools
import os
import re

from ..errors import MicroDDPError


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise MicroDDPError(f"SLURM node list {text!r} has unbalanced brackets")
    parts.append(text[start:])
    return [p for p in parts if p]


def _range(spec: str, whole: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: zero padding kept as written."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise MicroDDPError(f"SLURM node list {whole!r}: {item!r} is not a number or range")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list in full, as `scontrol show hostnames` gives it:
    'node[01-03,7],login1' -> ['node01', 'node02', 'node03', 'node7', 'login1'] and
    'r[1-2]n[1-2]' -> ['r1n1', 'r1n2', 'r2n1', 'r2n2']."""
    hosts = []
    for part in _split_top(text.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_range(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE in full: '2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise MicroDDPError(f"SLURM_TASKS_PER_NODE={text!r} is not like '2(x3),1'")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def from_slurm(env: dict | None = None) -> dict[str, str]:
    """torchrun's variables from SLURM's, for a task that `srun` started directly; {} when this
    is not a SLURM task, or when torchrun's RANK is set (torchrun under SLURM wins)."""
    env = os.environ if env is None else env
    if env.get("RANK") or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        node = int(env.get("SLURM_NODEID", "0"))
        if node < len(counts):
            out["LOCAL_WORLD_SIZE"] = str(counts[node])
    if not env.get("MASTER_ADDR"):
        if not nodes:
            raise MicroDDPError("SLURM task without SLURM_JOB_NODELIST: set MASTER_ADDR to the "
                                "first node's address")
        out["MASTER_ADDR"] = expand_nodelist(nodes)[0]
    if not env.get("MASTER_PORT"):
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        out["MASTER_PORT"] = str(20000 + job % 20000)  # the same on every task of the job
    return out
