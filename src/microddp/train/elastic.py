"""`microddp train --elastic`: data parallelism that loses a rank and keeps training in place.

Every replica holds the same parameters and optimizer state, so when a rank dies the others
need nothing from disk: they drop the step that failed, form a new process group among
themselves (elastic_group.py: a new generation in the store) and run that step again. The
global batch stays the same: batch b of an epoch is always the same samples, cut into as many
slices as there are members, so the survivors take over the lost rank's share and the run is
still one process's sequence of global batches (equal within float rounding: the sum of the
slices' gradients is added in another order).

A step is one flat all-reduce of the gradients, the loss, and a count of every sample used
(an indicator per training sample): the reduction itself says which samples the step used,
and each member appends that to samples-<id>.jsonl, so a test can check that every sample was
used exactly once per epoch. If members completed different steps (a group broke after some
finished the all-reduce), the one furthest on sends its state to the others.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import checkpoint
from ..data import ShardedBatchSampler, Split, load_dataset
from ..monitor.memory import measure
from ..world.rendezvous import store_args
from .build import build_model, build_optimizer
from .config import TrainConfig
from .elastic_group import Fenced, MemberLost, Membership, member_id

JOIN_ENV = "MICRODDP_ELASTIC_JOIN"  # set by the launcher for a replacement rank
STEP_SLEEP_ENV = "MICRODDP_ELASTIC_STEP_S"  # tests: seconds each step sleeps (room to join)
FAULT_ENV = "MICRODDP_ELASTIC_FAULT"  # tests: "kill:ID:STEP" or "stop:ID:STEP:SECONDS"
FENCED_EXIT = 3
BELOW_MIN_EXIT = 1


def _local_evaluate(module: torch.nn.Module, split: Split, batch_size: int = 1024) -> dict:
    """Loss and accuracy over the whole split on this rank alone (every replica is whole)."""
    module.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(split), batch_size):
            x, y = split.x[lo:lo + batch_size], split.y[lo:lo + batch_size]
            logits = module(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double().item()
            correct += int((logits.argmax(dim=1) == y).sum())
    module.train()
    return {"loss": loss_sum / len(split), "accuracy": correct / len(split)}


def _fault(me: int, step: int, out: Path) -> None:
    """The test hook: this rank SIGKILLs or SIGSTOPs itself in the middle of `step`."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, who, when, *rest = spec.split(":")
    if int(who) != me or int(when) != step:
        return
    (out / "fault.json").write_text(json.dumps({"kind": kind, "id": me, "step": step,
                                                "time": time.time(), "pid": os.getpid()}))
    if kind == "stop":  # a helper wakes it later, to prove a woken rank is fenced out
        subprocess.Popen(["sh", "-c", f"sleep {rest[0]}; kill -CONT {os.getpid()}"],
                         start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def _to_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _broadcast_bytes(group: Membership, data: bytes | None, root: int) -> dict:
    """`data` (a torch.save'd state) from group rank `root` to every member, loaded."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    group.wait(group.pg.broadcast([size], opts))
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
           else torch.empty(int(size), dtype=torch.uint8))
    group.wait(group.pg.broadcast([buf], opts))
    return torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True)


class ElasticJob:
    """One member's state: model, optimizer, where it is in the data, and its log files."""

    def __init__(self, cfg: TrainConfig, group: Membership) -> None:
        self.cfg, self.group, self.out = cfg, group, Path(cfg.out)
        data = load_dataset(cfg.dataset)
        self.train_set, self.test_set = data.train, data.test
        self.module = build_model(cfg, data.in_features, data.n_classes, torch.device("cpu"))
        self.optimizer = build_optimizer(cfg, self.module.parameters())
        self.sampler = ShardedBatchSampler(len(self.train_set), cfg.batch_size, seed=cfg.seed,
                                           allow_empty=True)
        self.per_epoch = len(self.sampler)
        total = self.per_epoch * cfg.epochs
        self.total = min(total, cfg.max_steps) if cfg.max_steps else total
        self.step = 0  # optimizer steps completed
        self.grow = False  # the last step's reduction said a replacement waits to join
        self.source: int | None = None  # whose state the last regrouping sent, if any
        self.samples_log = self.out / f"samples-{group.me}.jsonl"

    # -- one step --------------------------------------------------------------------------
    def run_step(self) -> float:
        """Global batch number `self.step`, this member's slice; the global mean loss."""
        epoch, b = divmod(self.step, self.per_epoch)
        batch = self.sampler.global_batches(epoch)[b]
        mine = torch.tensor_split(batch, self.group.size)[self.group.rank]
        x, y = self.train_set.x[mine], self.train_set.y[mine]
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = F.cross_entropy(self.module(x).float(), y, reduction="sum")
        (loss_sum / len(batch)).backward()  # summed over members: the global batch's mean
        _fault(self.group.me, self.step, self.out)
        used = torch.zeros(len(self.train_set))
        used[mine] = 1.0
        grads = [p.grad for p in self.module.parameters()]
        # A member that saw a replacement register says so in the step's own reduction, so
        # every member grows the group after the same step.
        joining = torch.tensor([1.0 if self.group.join_pending() else 0.0])
        flat = torch.cat([*(g.reshape(-1) for g in grads), joining,
                          loss_sum.detach().reshape(1) / len(batch), used])
        # Raises when a member is lost: gloo's error for a dead peer, MemberLost for a frozen one.
        self.group.wait(self.group.pg.allreduce([flat]))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.grow = flat[offset].item() > 0
        loss, counts = flat[offset + 1].item(), flat[offset + 2:]
        self.group.check_current()  # a woken, fenced rank stops here, before any write
        self.optimizer.step()
        self.step += 1
        with self.samples_log.open("a") as f:  # what the reduction says this step used
            f.write(json.dumps({"step": self.step, "epoch": epoch, "batch": b,
                                "gen": self.group.gen, "members": self.group.members,
                                "time": time.time(),
                                "used": torch.nonzero(counts).flatten().tolist(),
                                "counts": sorted(set(counts[counts != 0].tolist()))}) + "\n")
        return loss

    # -- state travels from the member furthest on ------------------------------------------
    def state(self) -> dict:
        """Everything a member needs to continue: parameters, optimizer state, the step."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step}

    def sync_from(self, steps: dict[int, int]) -> int | None:
        """If members stand at different steps, the furthest (lowest id of those) sends its
        state to all; return its id, or None when nothing had to travel."""
        best = max(steps.values())
        if all(s == best for s in steps.values()):
            return None
        source = min(m for m, s in steps.items() if s == best)
        state = _broadcast_bytes(self.group, _to_bytes(self.state()) if self.group.me == source
                                 else None, self.group.members.index(source))
        if self.group.me != source:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = state["step"]
        return source

    def save(self) -> Path:
        """A checkpoint of the replica (the leader's; every member holds the same)."""
        epoch, position = divmod(self.step, self.per_epoch)
        return checkpoint.save({"format": checkpoint.FORMAT, **self.state(), "epoch": epoch,
                                "position": position, "elastic": True,
                                "world_size": self.group.size,
                                "config": self.cfg.resume_settings()},
                               self.cfg.ckpt_dir, self.step, self.cfg.keep)


def _log(job: ElasticJob, record: dict) -> None:
    """Append a record to metrics.jsonl: the leader's voice (another after a leader is lost)."""
    if job.group.leader:
        with (job.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({**record, "time_unix": time.time()}) + "\n")


def _say(job: ElasticJob, text: str) -> None:
    if job.group.leader:
        print(text, flush=True)


def run(cfg: TrainConfig) -> int:
    """One member of an elastic job (under `microddp run`/`microddp train`, or torchrun)."""
    me, n = member_id(), int(os.environ.get("WORLD_SIZE", "1"))
    store = store_args(None, None, int(os.environ.get("RANK", "0")), n,
                       timedelta(seconds=60))["store"]
    group = Membership(store, me, cfg.elastic_timeout)
    joiner = os.environ.get(JOIN_ENV) == "1"
    # Data and model first: their imports and loading would otherwise hold up this member's
    # heartbeats (and a replacement's way in) for seconds.
    job = ElasticJob(cfg, group)
    try:
        if joiner:  # a replacement: in at a step boundary, its state from a live member
            steps = group.join()
            job.source = job.sync_from(steps)
            print(f"[id {me}] joined generation {group.gen} at step {job.step}: "
                  f"{group.size} ranks {group.members}, state from id {job.source}", flush=True)
        else:
            group.start(list(range(n)))
            group.form()
        code = _train(job, fresh=not joiner)
    except Fenced as e:
        print(f"[id {me}] {e}; exiting without writing", file=sys.stderr, flush=True)
        code = FENCED_EXIT
    group.stop()
    if group.abandoned:
        # A group left with a call still waiting on a frozen peer: its thread ends only at
        # gloo's timeout, and freeing it at exit would wait for that (or abort the process).
        # Everything of ours is written and flushed: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _regroup(job: ElasticJob, broken: bool) -> bool:
    """Form the next generation (again, if a member is lost meanwhile) and bring every member
    to the furthest member's state; False if fewer than --min-ranks are left (then the
    leader has saved a checkpoint and said so in one line)."""
    group, cfg = job.group, job.cfg
    while True:
        steps = group.reform(job.step, broken=broken)
        if group.size < cfg.min_ranks:
            path = job.save() if group.leader else None
            _say(job, f"microddp train --elastic: {group.size} rank(s) left, fewer than "
                      f"--min-ranks {cfg.min_ranks}; stopping at step {job.step}; last "
                      f"checkpoint {path}")
            return False
        try:
            job.source = job.sync_from(steps)
            return True
        except (RuntimeError, MemberLost):
            broken = True


def _train(job: ElasticJob, fresh: bool = True) -> int:
    cfg, group = job.cfg, job.group
    if group.leader and fresh:
        (job.out / "metrics.jsonl").write_text("")
    _say(job, f"microddp train --elastic: {group.size} ranks, dp over gloo, {cfg.dataset}, "
              f"global batch {cfg.batch_size}, {job.total} steps; survives losing ranks down "
              f"to --min-ranks {cfg.min_ranks}")
    log_every = cfg.log_every or max(1, job.per_epoch // 5)
    failed_at: float | None = None
    lost: list[int] = []
    t0 = time.perf_counter()
    while job.step < job.total:
        error = None
        try:
            loss = job.run_step()
        except (RuntimeError, MemberLost, dist.DistError) as e:
            # Re-formed out of the except block: the traceback's frames hold the old group.
            text = str(e).splitlines()[0] if str(e) else ""
            error = f"{type(e).__name__}: {text.rpartition('] ')[2][:100]}"  # no gloo path
        if error is not None:
            failed_at = failed_at or time.time()
            before = group.members
            if not _regroup(job, broken=True):
                return BELOW_MIN_EXIT
            lost = [m for m in before if m not in group.members]
            _say(job, f"lost id(s) {lost} at step {job.step + 1} ({error}); "
                      f"generation {group.gen}: {group.size} ranks {group.members}"
                      + (f", state from id {job.source}" if job.source is not None else ""))
            continue
        if job.grow:  # every member saw the same flag in the same reduction
            before, t_grow = group.members, time.time()
            if not _regroup(job, broken=False):
                return BELOW_MIN_EXIT
            joined = [m for m in group.members if m not in before]
            _say(job, f"joined id(s) {joined} after step {job.step}: generation {group.gen}, "
                      f"{group.size} ranks {group.members}, state from id {job.source}")
            _log(job, {"kind": "membership", "step": job.step, "gen": group.gen,
                       "joined": joined, "lost": [m for m in before if m not in group.members],
                       "members": group.members, "pause_s": round(time.time() - t_grow, 3)})
        if os.environ.get(STEP_SLEEP_ENV):
            time.sleep(float(os.environ[STEP_SLEEP_ENV]))
        if failed_at is not None:  # the first step completed after a loss: the pause ends
            pause = time.time() - failed_at
            _log(job, {"kind": "membership", "step": job.step, "gen": group.gen,
                       "lost": lost, "members": group.members, "pause_s": round(pause, 3)})
            _say(job, f"membership: lost {lost}, step {job.step} done {pause:.2f} s after "
                      "the failure was seen")
            failed_at = None
        epoch, done = divmod(job.step, job.per_epoch)
        if job.step % log_every == 0 or done == 0 or job.step == job.total:
            _say(job, f"step {job.step}/{job.total}  loss {loss:.4f}  ranks {group.size}")
            _log(job, {"kind": "step", "step": job.step, "epoch": epoch + (done > 0),
                       "loss": loss, "ranks": group.size, "gen": group.gen})
        if cfg.checkpoint_every and job.step % cfg.checkpoint_every == 0 and group.leader:
            job.save()
    seconds = time.perf_counter() - t0
    evaluated = _local_evaluate(job.module, job.test_set)
    if group.leader:
        job.save()
        tmp = job.out / ".model.pt.tmp"
        torch.save(job.module.state_dict(), tmp)
        tmp.replace(job.out / "model.pt")
        rate = job.step * cfg.batch_size / max(seconds, 1e-9)
        _log(job, {"kind": "final", "step": job.step, "test_accuracy": evaluated["accuracy"],
                   "test_loss": evaluated["loss"], "samples_per_s": rate, "strategy": "dp",
                   "elastic": True, "ranks": group.size, "generations": group.gen + 1,
                   "memory": [{"rank": group.me, **measure(job.module, job.optimizer)}]})
        _say(job, f"done: test accuracy {100 * evaluated['accuracy']:.2f}% after {job.step} "
                  f"steps on {group.size} rank(s); wrote {job.out / 'model.pt'}")
    return 0
