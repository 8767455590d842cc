"""This rank's recent collectives as a PyTorch Flight Recorder dump, read by `torchfrtrace`.

PyTorch's Flight Recorder keeps a ring buffer of collectives per rank and dumps it on a timeout;
torch's analyser (`torchfrtrace DIR`, torch/distributed/flight_recorder/) matches the dumps of
all ranks and names the first collective they disagree on and the rank that is missing or
different. On gloo, torch's own recorder writes no durations and no completion state. microddp
writes the same file format from its monitor's log (monitor/log.py): every entry with its state
(completed or started), its duration, its group's members, its sequence number and its caller's
file:line, for torch's own collectives and microddp's (logged as their torch kind, the profiling
name says whose: `gloo:all_reduce microddp.ring_all_reduce`), and the point-to-point messages
of microddp.comms (a pipeline's, a parameter server's: monitor/messages.py) as torch's
`send 0->1` / `recv 1<-0` entries, numbered apart (p2p_seq_id, negated: see build).

The dump is written when the ranks are asked where they are (a hang or a backend timeout, see
hang.py), into RUN/flight_recorder/ (set_run_dir, or MICRODDP_RUN_DIR), else into a folder the
reporting rank names for every rank (runs/hang-DATE-TIME); also to TORCH_FR_DUMP_TEMP_FILE<rank>
if that is set, as torch does. The file is a pickle, as torch's is: written here, read by
torch's tool on the user's machine; microddp itself never unpickles one.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .log import Entry

VERSION = "2.10"  # the format torch 2.13's own recorder writes (its dumps say so)
FOLDER = "flight_recorder"
PREFIX = "fr_trace_rank_"
ENV_RUN = "MICRODDP_RUN_DIR"
ENV_TORCH = "TORCH_FR_DUMP_TEMP_FILE"

# microddp's own collectives and torch's object/tensor variants, as the kinds torch's analyser
# knows (it refuses any other name); the profiling name keeps microddp's own name beside it.
_KIND = {
    "ring_all_reduce": "all_reduce", "tree_all_reduce": "all_reduce",
    "naive_all_reduce": "all_reduce", "hierarchical_all_reduce": "all_reduce",
    "shm_all_reduce": "all_reduce", "ring_reduce_scatter": "reduce_scatter",
    "shm_reduce_scatter": "reduce_scatter", "ring_all_gather": "all_gather",
    "shm_all_gather": "all_gather", "tree_broadcast": "broadcast", "shm_broadcast": "broadcast",
    "tree_reduce": "reduce", "collectives.scatter": "scatter", "collectives.gather": "gather",
    "all_gather_into_tensor": "_all_gather_base", "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_gather_object": "all_gather", "gather_object": "gather",
    "broadcast_object_list": "broadcast", "scatter_object_list": "scatter",
}
# torch's ScalarType names, which its dumps carry (`Float`, not `float32`)
_DTYPE = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
          "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
          "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}
_SHAPE = re.compile(r"^(?:(\d+)x)?(\w+)\[([\d,]*)\]$")

_run_dir: list = [None]


def set_run_dir(path: str | os.PathLike | None) -> None:
    """Where this job's dumps go: PATH/flight_recorder/ (None: MICRODDP_RUN_DIR, else a folder
    the reporting rank names)."""
    _run_dir[0] = None if path is None else str(path)


def run_dir() -> str | None:
    """The job's run folder, if one is known (set_run_dir, or MICRODDP_RUN_DIR)."""
    return _run_dir[0] or os.environ.get(ENV_RUN) or None


def choose_folder() -> str:
    """The folder for this hang's dumps, chosen by the reporting rank for every rank."""
    base = run_dir()
    if base is not None:
        return str(Path(base) / FOLDER)
    return str(Path("runs") / f"hang-{time.strftime('%Y%m%d-%H%M%S')}" / FOLDER)


def kind(op: str) -> str:
    """The Flight Recorder's name for a logged op (all_reduce for ring_all_reduce)."""
    return _KIND.get(op, op)


def _sizes(entry: Entry, kind_: str, group_size: int) -> tuple[list, list, list]:
    """(input_sizes, output_sizes, dtypes) of a call, from its described tensor. The log
    describes one tensor: the input of all_gather, the output of reduce_scatter and of
    all_gather_into_tensor; the other side follows from the group's size, as torch's
    analyser checks it (numel times the group's size)."""
    m = _SHAPE.match(entry.shape or "")
    if m is None:
        return [[]], [[]], []
    count, dtype, dims = m.groups()
    shape = [int(d) for d in dims.split(",") if d]
    numel = 1
    for d in shape:
        numel *= d
    dtypes = [_DTYPE.get(dtype, dtype)] * (int(count) if count else 1)
    sizes = [shape] * (int(count) if count else 1)
    if kind_ == "all_gather":
        return sizes, [[numel * group_size]], dtypes
    if kind_ in ("_all_gather_base", "_reduce_scatter_base", "reduce_scatter"):
        return [[numel * group_size]], sizes, dtypes
    return sizes, sizes, dtypes


def groups() -> dict[str, dict]:
    """torch's groups as the Flight Recorder's pg_config: name -> desc, ranks."""
    out: dict[str, dict] = {}
    try:
        world = dist.distributed_c10d._world  # torch's registry of groups: no public listing
        names = dict(world.pg_names)
        ranks = dict(world.pg_group_ranks)
    except (AttributeError, RuntimeError):
        return out
    default = dist.GroupMember.WORLD
    for pg, name in names.items():
        members = sorted(ranks.get(pg, {}))
        desc = "default_pg" if pg is default else (getattr(pg, "group_desc", "") or "undefined")
        out[str(name)] = {"name": str(name), "desc": desc, "ranks": str(members)}
    return out


# pg_status's fields, as torch's recorder writes them
_STATUS = tuple(f"last_{step}_{which}" for which in ("collective", "p2p")
                for step in ("enqueued", "started", "completed"))


def _group_rank(rank: int, members: str) -> int:
    """A global rank's place in a group whose pg_config lists `members` ("[0, 2]")."""
    ranks = [int(r) for r in members.strip("[]").split(",") if r.strip()]
    return ranks.index(rank) if rank in ranks else rank


def _pg_of(group: str, config: dict[str, dict], world_name: str) -> str:
    return world_name if group == "world" else group


def _frames(entry: Entry) -> list[dict]:
    """The caller's frames, innermost first, as torch's dumps list them."""
    loc = entry.location()
    return [{"name": code.co_name, "filename": code.co_filename, "line": line}
            for code, line in loc]


def build(entries: list[Entry], rank: int, timeout_s: float) -> dict[str, Any]:
    """The Flight Recorder dump of `entries` (this rank's log, oldest first)."""
    config = groups()
    default = dist.GroupMember.WORLD
    world_name = str(dist.distributed_c10d._world.pg_names.get(default, "0")) if default else "0"
    ids = {name: i for i, name in enumerate(config)}
    offset_ns = time.time_ns() - time.monotonic_ns()
    status: dict[str, dict] = {}
    rows = []
    # patch.point_to_point's waits are for the hang report: the messages themselves are in
    # the dump already, with both ends (messages.py)
    entries = [e for e in entries if e.group != "p2p"]
    for e in entries:
        pg = _pg_of(e.group, config, world_name)
        members = config.get(pg, {}).get("ranks", "[]")
        size = max(len(members.strip("[]").split(",")) if members != "[]" else 1, 1)
        kind_ = kind(e.op)
        ins, outs, dtypes = _sizes(e, kind_, size)
        done = e.done is not None and not e.failed
        p2p = e.ends is not None
        if p2p:  # torch's names: `send 0->1` on the sender, `recv 1<-0` on the receiver
            src, dst = (_group_rank(r, members) for r in e.ends[:2])
            name = f"gloo:send {src}->{dst}" if e.op == "send" else f"gloo:recv {dst}<-{src}"
        else:
            name = f"gloo:{kind_}" + (f" microddp.{e.op}" if kind_ != e.op else "")
        started_ns = int(e.started * 1e9) + offset_ns
        rows.append({
            "frames": _frames(e), "record_id": e.record, "pg_id": ids.get(pg, -1),
            "process_group": (pg, config.get(pg, {}).get("desc", "undefined")),
            "thread_name": "python", "thread_id": str(threading.main_thread().ident),
            "collective_seq_id": e.collective_seq if p2p else e.seq,
            # negated: torch's analyser takes an entry whose p2p_seq_id equals the collective
            # before it (or whose collective_seq_id equals the message before it) as one
            # coalesced group with it, and then fails on it; the numbers never meet so
            "p2p_seq_id": -e.seq if p2p else 0, "op_id": e.seq,
            "profiling_name": name, "time_created_ns": started_ns,
            "input_sizes": ins, "input_dtypes": dtypes, "output_sizes": outs,
            "output_dtypes": dtypes, "state": "completed" if done else "started",
            "time_discovered_started_ns": started_ns,
            "time_discovered_completed_ns": int(e.done * 1e9) + offset_ns if done else None,
            "duration_ms": (e.done - e.started) * 1e3 if done else None,
            "retired": e.done is not None, "timeout_ms": int(timeout_s * 1e3), "is_p2p": p2p,
        })
        st = status.setdefault(str(ids.get(pg, -1)), dict.fromkeys(_STATUS, -1))
        which = "p2p" if p2p else "collective"
        for step in ("enqueued", "started") + (("completed",) if done else ()):
            key = f"last_{step}_{which}"
            st[key] = max(st[key], e.seq)
    return {"version": VERSION, "pg_config": config, "pg_status": status,
            "comm_lib_version": "microddp", "rank": rank,
            "entries": _paired(rows, [e.ends for e in entries])}


def _paired(rows: list[dict], ends: list) -> list[dict]:
    """The rows, each run of messages between two collectives put in channel order.

    torch's analyser pairs the k-th message of one rank's run with the k-th of its peer's (it
    has no other key), so a pipeline that posts its receives ahead (runtime.py) reads as a
    mismatch in call order. A message's true partner is the one with the same number in the
    same channel (source, destination, tag): messages of a channel arrive in the order they
    were sent. Listed by channel and number, a rank's messages line up with its peer's, each
    beside its partner, and torchfrtrace pairs them. The run's record_ids are dealt out again
    in the new order (the analyser takes a dump as sorted by them, and drops what is not);
    the times stay the calls' own.
    """
    out: list[dict] = []
    run: list[tuple] = []

    def flush() -> None:
        ids = sorted(r["record_id"] for _, r in run)
        for record_id, (_, row) in zip(ids, sorted(run, key=lambda x: x[0]), strict=True):
            out.append({**row, "record_id": record_id})
        run.clear()

    for row, key in zip(rows, ends, strict=True):
        if key is None:
            flush()
            out.append(row)
        else:
            run.append((key, row))
    flush()
    return out


def write(entries: list[Entry], rank: int, timeout_s: float, folder: str) -> list[Path]:
    """Write this rank's dump into `folder` (and TORCH_FR_DUMP_TEMP_FILE<rank>); the paths."""
    data = pickle.dumps(build(entries, rank, timeout_s))
    targets = [Path(folder) / f"{PREFIX}{rank}"]
    if os.environ.get(ENV_TORCH):
        targets.append(Path(f"{os.environ[ENV_TORCH]}{rank}"))
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader never sees half a dump
    return targets
