"""The interpreter: run any schedule's program for this rank's stages, with send and recv.

Sends are posted with isend and waited for only where surely done (a gloo point-to-point
handle cannot be polled; chapter 2): once a message has arrived that its receiver sent after
receiving it, the rest at the end of the step. A receive is waited for where the program
says, so a rank blocks exactly where `validate`'s model (receives block, sends do not) proved
the schedule free of deadlock, but it is *posted* (irecv) ahead: gloo moves a message only
once both sides have posted it, and a receive posted after its send pays a round trip through
both ranks' gloo threads (chapter 8). At most `window(schedule, rank)` receives are posted
and not yet waited for: the most micro-batches the rank's program holds at once, which it
pays in memory anyway (GPipe: all m; 1F1B: p - r), a gradient's no earlier than its forward.
Every receive posted is one the program waits for later, so the window adds no wait the
validator did not see. Buffers held for messages are counted by an `ActivationMeter`
(`activations.hold`); tags (ACT or GRAD, boundary, micro-batch) keep two messages between the
same ranks apart. `run_schedule`'s micro-batch i loss is `loss_fn(out_i, y_i) * n_i / n`, so
the gradients accumulated over the micro-batches are one process's on the whole batch. The
torch-shaped classes (schedule_classes.py) run the same `execute` with their own inputs,
loss and receive shapes (a `_Step`'s hooks), and forward-only programs.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .. import comms
from ..errors import MicroDDPError
from ..monitor import note
from .activations import hold
from .boundary import TENSOR_TAG_STRIDE, as_tuple, grad_like, input_grads, mark_inputs, pairs
from .schedules import COMPUTE, RECVS, SENDS, Action, Schedule, message_key
from .step_check import start_agreement

CHECKED_STAGES = 32  # stages whose widths run_schedule's agreement compares (3 words each)
STAGE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def window(schedule: Schedule, rank: int) -> int:
    """How many receives `rank` keeps posted ahead of its program, at most: the most
    micro-batches its program holds at once (a stage's micro-batch from its F to its B or W),
    and at least 2. A posted activation's buffer becomes the input its stage then holds, so
    the window costs no more memory than the schedule's own peak, give or take one buffer:
    1F1B's last rank holds one micro-batch, and posting its next two receives, not one, took
    0.98x and 0.88x of the step (p = 2, m = 4 and 8, interleaved steps, load average 3)."""
    held, most = set(), 2
    for a in schedule.actions[rank]:
        if a.kind == "F":
            held.add((a.stage, a.mb))
            most = max(most, len(held))
        elif a.kind in ("B", "W"):
            held.discard((a.stage, a.mb))
    return most


def microbatch_sizes(batch: int, m: int) -> list[int]:
    """Sizes of the m micro-batches of a batch of `batch` samples, as torch.tensor_split cuts
    it: they differ by at most one sample, the larger first, so the last is never larger."""
    if m < 1 or batch < m:
        raise MicroDDPError(f"cannot cut a batch of {batch} samples into {m} micro-batches: "
                            "use between 1 and the batch size micro-batches")
    base, extra = divmod(batch, m)
    return [base + (1 if i < extra else 0) for i in range(m)]


def _input_width(module: nn.Module) -> int:
    first = next((mod for mod in module.modules() if isinstance(mod, nn.Linear)), None)
    if first is None:
        raise MicroDDPError("a pipeline stage must start with an nn.Linear, so that a rank "
                            "knows the shape of the activations it receives; split a FullMLP "
                            "with microddp.pipeline.split_model")
    return first.in_features


def _widths(module: nn.Module) -> tuple[int, int]:
    """(input width, output width) of a stage whose first and last modules holding parameters
    are nn.Linear (a FullMLP's slices); 0 for an end that is not, which the agreement then
    leaves unchecked rather than guess (a GPT stage starts with an embedding)."""
    holders = [mod for mod in module.modules()
               if next(mod.parameters(recurse=False), None) is not None]
    if not holders:
        return 0, 0
    first, last = holders[0], holders[-1]
    return (first.in_features if isinstance(first, nn.Linear) else 0,
            last.out_features if isinstance(last, nn.Linear) else 0)


def check_step(schedule: Schedule, stages: dict[int, nn.Module], x: torch.Tensor,
               y: torch.Tensor, group) -> Callable[[], None]:
    """run_schedule's agreement (step_check.py), started: the function it returns waits for
    it and raises, alike on every rank, unless every rank passed the same batch and schedule
    and each stage's input width and dtype are what the stage before it gives. The step calls
    it before its first message, so nothing of the wrong size moves (a mismatch used to abort
    gloo, or wait to the timeout). Widths are checked for the first CHECKED_STAGES stages."""
    rank, where = comms.group_rank(group), f"run_schedule({schedule.name})"
    problem, slots = None, [0] * (3 * CHECKED_STAGES)
    try:
        if sorted(stages) != schedule.stages_of(rank):
            raise MicroDDPError(f"rank {rank} holds stages {sorted(stages)}, but schedule "
                                f"{schedule.name} gives it stages {schedule.stages_of(rank)}")
        if len(x) != len(y):
            raise MicroDDPError(f"{where}: x has {len(x)} samples but y {len(y)}; pass the "
                                "targets of this very batch")
        microbatch_sizes(len(x), schedule.microbatches)  # raises, saying what to do
        for s, module in stages.items():
            if s < CHECKED_STAGES:
                dtype = next(module.parameters(), torch.empty(0)).dtype
                slots[3 * s:3 * s + 3] = [*_widths(module), STAGE_DTYPES.index(dtype) + 1
                                          if dtype in STAGE_DTYPES else 99]
    except MicroDDPError as error:
        problem = error
    agreement = start_agreement(group, where, problem, equal={
        "schedule": schedule.name, "ranks": schedule.ranks, "stages": schedule.stages,
        "microbatches": schedule.microbatches, "batch size": len(x)}, slots=slots,
        device=x.device)
    if problem is not None:
        agreement.result()  # raises: this rank's step cannot even start
    return lambda: _check_widths(schedule, where, agreement.result()[1])


def _check_widths(schedule: Schedule, where: str, got: list[int]) -> None:
    for s in range(min(schedule.stages, CHECKED_STAGES) - 1):
        (_, out, before), (inp, _, after) = (got[3 * s:3 * s + 3], got[3 * s + 3:3 * s + 6])
        if out and inp and (out, before) != (inp, after):
            name = {k + 1: str(v).removeprefix("torch.") for k, v in enumerate(STAGE_DTYPES)}
            raise MicroDDPError(
                f"{where}: stage {s} (rank {schedule.rank_of(s)}) gives width {out} "
                f"{name.get(before, 'other')} but stage {s + 1} (rank {schedule.rank_of(s + 1)})"
                f" takes width {inp} {name.get(after, 'other')}; build the same model, "
                "with the same width and dtype, on every rank")


def _tag(key: tuple[str, int, int], m: int) -> int:
    kind, boundary, mb = key
    return (2 * boundary + (kind == "GRAD")) * m + mb


# (id(schedule), rank) -> (the schedule, weakly; its sends-done map): worked out once per
# schedule, not every step (it scans each send's peer program: 9 ms a step at p = 8, m = 64).
_DONE_AFTER: dict[tuple[int, int], tuple[weakref.ref, dict[tuple, list[tuple]]]] = {}


def _sends_done_after(schedule: Schedule, rank: int) -> dict[tuple, list[tuple]]:
    """{message this rank receives: its sends surely done once that message has arrived}, a
    fresh copy each call (the step pops from it).

    A peer that sends us a message after (in its program) receiving one of ours has received
    ours: our send is done, and waiting for it then returns at once, without depending on
    anything else. Waited for there, a sent tensor goes early, not at the step's end (so that
    1F1B keeps holding about p - r micro-batches, its sent activations included)."""
    hit = _DONE_AFTER.get((id(schedule), rank))
    if hit is None or hit[0]() is not schedule:
        if len(_DONE_AFTER) > 64:
            _DONE_AFTER.clear()
        hit = (weakref.ref(schedule), _work_out_sends_done_after(schedule, rank))
        _DONE_AFTER[(id(schedule), rank)] = hit
    return {k: list(v) for k, v in hit[1].items()}


def _work_out_sends_done_after(schedule: Schedule, rank: int) -> dict[tuple, list[tuple]]:
    done: dict[tuple, list[tuple]] = {}
    for a in schedule.actions[rank]:
        if a.kind not in SENDS:
            continue
        key, program = message_key(a), schedule.actions[schedule.peer(a)]
        at = next((i for i, b in enumerate(program)
                   if b.kind in RECVS and message_key(b) == key), None)
        if at is None:
            raise MicroDDPError(f"schedule {schedule.name}: rank {rank}'s {a} has no matching "
                                f"receive on rank {schedule.peer(a)}; check the "
                                "schedule with microddp.pipeline.validate")
        reply = next((b for b in program[at + 1:]
                      if b.kind in SENDS and schedule.peer(b) == rank), None)
        if reply is not None:
            done.setdefault(message_key(reply), []).append(key)
    return done


class _Step:
    """One rank's state during one step: what each action leaves for the next ones."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], group, rank: int,
                 feed: Callable[[int], tuple], finish: Callable,
                 kwargs: Callable[[int], dict] | None = None,
                 act_like: Callable[[Action], torch.Tensor] | None = None,
                 ready: Callable[[], object] | None = None):
        self.schedule, self.stages, self.group, self.rank = schedule, stages, group, rank
        self.feed = feed          # mb -> the first stage's positional inputs
        self.finish = finish      # (last stage's output, mb) -> what its backward starts from
        self.kwargs = kwargs or (lambda mb: {})  # mb -> keyword inputs of every stage
        self.act_like = act_like  # RECV_ACT -> new empty tensor(s) shaped as its message
        # waited for before this rank's first message (the step's agreement: step_check.py)
        self.ready = ready
        self.forward_only = not any(a.kind in ("B", "I", "W") for a in schedule.actions[rank])
        self.inputs: dict = {}     # (stage, mb) -> the stage's input (a leaf needing grad)
        self.outputs: dict = {}    # (stage, mb) -> the stage's output, or the loss last
        self.out_grads: dict = {}  # (stage, mb) -> gradient of that output (None for a loss)
        self.in_grads: dict = {}   # (stage, mb) -> gradient of the input, to send down
        self.sends: dict = {}      # message key -> handle of a send not yet waited for
        self.sent_bytes = 0
        self.posted: dict = {}     # (kind, stage, mb) -> (handle, buffer) of a posted receive
        # this rank's receives in program order; the first `next_post` of them are posted
        self.receives = [a for a in schedule.actions[rank] if a.kind in RECVS]
        self.next_post = 0
        self.waited = (0.0, 0.0)   # (start, end) of the last receive's wait for its data
        self.window = window(schedule, rank)
        self.done_after = _sends_done_after(schedule, rank)

    def settle(self) -> None:
        """Wait for the step's agreement, once, before the first message is posted."""
        if self.ready is not None:
            ready, self.ready = self.ready, None
            # a hang report names it: a rank stuck here waits for a rank not in this step
            note(f"{self.schedule.name}: the step's agreement (every rank of the pipeline "
                 "starts the step)")
            ready()

    def send(self, a: Action, values: tuple[torch.Tensor, ...]) -> None:
        """Post the sends of message `a`: one per tensor of the boundary value."""
        self.settle()
        peer = self.schedule.peer(a)
        where = {"dst": peer} if self.group is None else {"group_dst": peer}
        tag = _tag(message_key(a), self.schedule.microbatches)
        handles = []
        for i, tensor in enumerate(values):
            tensor = tensor.detach().contiguous()
            hold(tensor)  # until the send is waited for (see `recv`), or the step's end
            handles.append(comms.isend(tensor, group=self.group,
                                       tag=tag + i * TENSOR_TAG_STRIDE, **where))
            self.sent_bytes += tensor.nbytes
        self.sends[message_key(a)] = handles

    def _buffer_like(self, a: Action) -> tuple[torch.Tensor, ...] | None:
        """Empty tensors shaped as receive `a`'s message, or None while that is not known
        (a gradient before its forward)."""
        if a.kind == "RECV_ACT":
            return as_tuple(self.act_like(a))  # fresh empty tensors: the buffers
        out = self.outputs.get((a.stage, a.mb))
        return None if out is None else grad_like(out)

    def post_ahead(self) -> None:
        """Post the next receives in program order while fewer than the window are posted
        and not yet waited for, stopping at a gradient whose forward has not run yet."""
        while self.next_post < len(self.receives) and len(self.posted) < self.window:
            self.settle()
            a = self.receives[self.next_post]
            like = self._buffer_like(a)
            if like is None:
                return
            peer = self.schedule.peer(a)
            where = {"src": peer} if self.group is None else {"group_src": peer}
            tag = _tag(message_key(a), self.schedule.microbatches)
            handles = []
            for i, buf in enumerate(like):
                hold(buf)  # until the tensor that reads it is done with it
                handles.append(comms.irecv(buf, group=self.group,
                                           tag=tag + i * TENSOR_TAG_STRIDE, **where))
            self.posted[(a.kind, a.stage, a.mb)] = (handles, like)
            self.next_post += 1

    def recv(self, a: Action) -> tuple[torch.Tensor, ...]:
        """Wait for receive `a` (posted now if the window had not reached it) and return its
        tensors; then post the next receives the window frees room for."""
        key = (a.kind, a.stage, a.mb)
        if key not in self.posted:
            self.post_ahead()  # every earlier receive was waited for: the window has room
        if key not in self.posted:
            raise MicroDDPError(f"schedule {self.schedule.name}: rank {self.rank} reaches {a} "
                                "before the forward whose output's gradient it receives; "
                                "put the forward first (microddp.pipeline.validate)")
        handles, bufs = self.posted.pop(key)
        start = time.perf_counter()
        for handle in handles:
            handle.wait()
        self.waited = (start, time.perf_counter())
        self.post_ahead()
        for sent in self.done_after.pop(message_key(a), ()):
            for handle in self.sends.pop(sent):
                handle.wait()  # done already: returns at once
        return bufs

    def input_grad(self, key: tuple[int, int]) -> None:
        """Hand the gradient of a stage's input to the stage below: kept here if that stage is
        on this rank (its B or I reads it), else left for SEND_GRAD."""
        s, mb = key
        if s == 0:
            return
        grad = input_grads(self.inputs[key])
        if self.schedule.rank_of(s - 1) == self.rank:
            self.out_grads[(s - 1, mb)] = grad
        else:
            self.in_grads[key] = grad


def run_schedule(schedule: Schedule, stages: dict[int, nn.Module], x: torch.Tensor,
                 y: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 *, group=None, record: list | None = None,
                 sent: list | None = None, messages: list | None = None) -> float | None:
    """Run this rank's program of `schedule` for one step; gradients accumulate into the
    parameters of `stages` ({stage index: module}, the stages this rank holds).

    `x`, `y` are the whole global batch (only the first stage reads x, only the last reads y);
    `loss_fn` reduces by the mean, like nn.functional.cross_entropy. Returns the batch's loss
    on the rank holding the last stage, None elsewhere. `group`: the pipeline's process group
    (default: the world), in which rank r runs program r. `record`, if given, receives
    (action, start, end) for every compute action, in time.perf_counter() seconds, which one
    host's processes share: the timeline the course and the benchmarks draw. `sent`, if
    given, receives the bytes of the activations and gradients this rank sent. `messages`, if
    given, receives (action, start, end, wait start, wait end) for every send and receive:
    the action's span and, for a receive, the span of its wait for the data (a send's is
    (end, end)), what `microddp predict --calibrate` reads a message's costs from.
    """
    rank = comms.group_rank(group)
    p = schedule.ranks
    if comms.group_size(group) != p:
        raise MicroDDPError(f"schedule {schedule.name} is for {p} ranks but the group has "
                            f"{comms.group_size(group)}; build it with p = the number of stages' ranks")
    ready = check_step(schedule, stages, x, y, group)
    m, n = schedule.microbatches, len(x)
    xs, ys = x.tensor_split(m), y.tensor_split(m)
    total = [0.0]

    def finish(out: torch.Tensor, mb: int) -> torch.Tensor:
        loss = loss_fn(out, ys[mb]) * (len(ys[mb]) / n)
        total[0] += loss.item()
        return loss

    def act_like(a: Action) -> torch.Tensor:
        module = stages[a.stage]
        return xs[a.mb].new_empty(len(xs[a.mb]), _input_width(module),
                                  dtype=next(module.parameters()).dtype)

    st = _Step(schedule, stages, group, rank, lambda mb: (xs[mb],), finish, act_like=act_like,
               ready=ready)
    execute(st, record=record, messages=messages)
    st.settle()  # a program with no message (one rank) still ends with the agreement
    if sent is not None:
        sent.append(st.sent_bytes)
    return total[0] if schedule.stages - 1 in stages else None


def execute(st: _Step, *, record: list | None = None, messages: list | None = None) -> None:
    """Run `st`'s rank's program to its end: every action, then every send waited for."""
    schedule = st.schedule
    try:
        st.post_ahead()
        for a in schedule.actions[st.rank]:
            note(a)  # a hang report names the action a stuck rank waits in
            start = time.perf_counter()
            _perform(st, a)
            end = time.perf_counter()
            if record is not None and a.kind in COMPUTE:
                record.append((a, start, end))
            elif messages is not None and a.kind not in COMPUTE:
                messages.append((a, start, end, *(st.waited if a.kind in RECVS else (end, end))))
        note(f"{schedule.name}: waiting for its sends to be received")
        for handles in st.sends.values():
            for handle in handles:
                handle.wait()
    finally:
        note(None)


def _perform(st: _Step, a: Action) -> None:
    """One action of this rank's program."""
    schedule, rank, last = st.schedule, st.rank, st.schedule.stages - 1
    key = (a.stage, a.mb)
    module = st.stages[a.stage]
    if a.kind == "RECV_ACT":
        st.inputs[key] = st.recv(a)
    elif a.kind == "F":
        if a.stage == 0:
            inputs = st.feed(a.mb)
        else:
            inputs = st.inputs[key]
            if not st.forward_only:
                mark_inputs(inputs)
        out = module(*inputs, **st.kwargs(a.mb))
        if a.stage == last:
            out = st.finish(out, a.mb)
            if st.forward_only:
                st.inputs.pop(key, None)
                return
            out = (out,)  # the loss: its backward starts from it, with no gradient
        else:
            out = as_tuple(out, f"stage {a.stage}'s output")
            if schedule.rank_of(a.stage + 1) == rank:
                # the next stage starts its own graph, so that B runs stage by stage
                st.inputs[(a.stage + 1, a.mb)] = tuple(t.detach() for t in out)
        if st.forward_only:
            st.inputs.pop(key, None)  # no backward will read it
        st.outputs[key] = out
        st.post_ahead()  # its gradient's receive may be next in the window
    elif a.kind == "SEND_ACT":
        st.send(a, st.outputs.pop(key) if st.forward_only else st.outputs[key])
    elif a.kind == "RECV_GRAD":
        st.out_grads[key] = st.recv(a)
    elif a.kind == "B":
        outs, grads = pairs(st.outputs.pop(key), st.out_grads.pop(key, None))
        if outs:
            torch.autograd.backward(outs, grads)
        st.input_grad(key)
        st.inputs.pop(key, None)
    elif a.kind == "I":
        # Zero-bubble's split, the simple way: I asks autograd for the input's gradient
        # only and keeps the graph; W later walks the same graph again for the weights.
        # W repeats the chain of activation gradients (it costs about a backward), but it
        # works for any stage module and needs nothing saved beside autograd's own graph.
        if a.stage > 0:
            outs, grads = pairs(st.outputs[key], st.out_grads.get(key))
            need = [t for t in st.inputs[key] if t.requires_grad]
            if outs and need:
                got = torch.autograd.grad(outs, need, grads, retain_graph=True,
                                          allow_unused=True)
                for t, g in zip(need, got, strict=True):
                    t.grad = g
            st.input_grad(key)
    elif a.kind == "W":
        params = [q for q in module.parameters() if q.requires_grad]
        outs, grads = pairs(st.outputs.pop(key), st.out_grads.pop(key, None))
        if outs and params:
            torch.autograd.backward(outs, grads, inputs=params)
        st.inputs.pop(key, None)
    elif a.kind == "SEND_GRAD":
        st.send(a, st.in_grads.pop(key))
