"""torch.distributed.pipelining's schedule classes over microddp's schedules and interpreter.

    from microddp.pipeline import PipelineStage, Schedule1F1B   # was: torch.distributed.pipelining
    stage = PipelineStage(part, rank, p, device)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    out = schedule.step(x) / schedule.step(target=y, losses=losses) / schedule.step()

`step` has torch's contract: the batch on the first stage's rank, the target on the last's,
nothing on the ones between; every tensor argument cut along dim 0 into the micro-batches; one
loss per micro-batch (`losses` gets them on the last stage), each backpropagated as it is, and
the gradients divided by the number of micro-batches at the end when `scale_grads` (torch's
default, right for a mean loss; pass scale_grads=False with a sum loss). The last stage
returns the merged output. `eval()` (or a schedule without loss_fn) runs the forwards only.
Each class picks one of microddp's instruction lists (schedules.py) and runs it with the one
interpreter (runtime.py), so any m >= 1 micro-batches works where torch refuses m < stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import MicroDDPError
from .interleaved_zb import interleaved_zero_bubble
from .runtime import _Step, execute, microbatch_sizes
from .schedules import (
    Action,
    Schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from .stage import PipelineStage, _meta_device, infer
from .step_check import agree_step, start_agreement
from .zbv import zbv_zero_bubble


class _PipelineSchedule:
    """What every schedule class shares; a subclass names its program in `_build(p, m, v)`."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True) -> None:
        name = type(self).__name__
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) \
                or n_microbatches < 1:
            raise MicroDDPError(f"{name}: n_microbatches must be an int >= 1, got "
                                f"{n_microbatches!r}")
        if any(spec is not None for spec in (args_chunk_spec, kwargs_chunk_spec,
                                             output_merge_spec)):
            raise MicroDDPError(f"{name}: chunk and merge specs are not supported; microddp "
                                "cuts every tensor argument along dim 0 and concatenates the "
                                "outputs along dim 0 (torch's defaults): leave them None")
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise MicroDDPError(f"{name}: give microddp.pipeline.PipelineStage objects")
        first = stages[0]
        if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
            raise MicroDDPError(f"{name}: the stages of one rank must share num_stages and group")
        p, v = first.group_size, len(stages)
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._n_microbatches, self._loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads
        self.program: Schedule = self._build(p, n_microbatches, v)
        want = self.program.stages_of(first.group_rank)
        if first.num_stages != p * v or [s.stage_index for s in self._stages] != want:
            raise MicroDDPError(f"{name}: rank {first.group_rank} of {p} must hold stages {want} "
                                f"of {p * v} ({self.program.placement} placement), got "
                                f"{[s.stage_index for s in self._stages]} of {first.num_stages}")
        self.forward_program: Schedule = forward_only(self.program)
        self._batch: int | None = None  # the batch size, learnt by the first step

    def _build(self, p: int, m: int, v: int) -> Schedule:
        raise NotImplementedError

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):
        """One training step on the whole batch (see the module docstring for who passes
        what); returns the merged output on the last stage's rank, None elsewhere."""
        train = self._loss_fn is not None
        if train and not torch.is_grad_enabled():
            raise MicroDDPError("step() runs the backward and needs autograd; under "
                                "torch.no_grad() call eval() instead")
        return self._run(args, kwargs, target, losses, return_outputs, loss_kwargs, train)

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Forwards only (no autograd graph kept); the losses too if loss_fn and target."""
        with torch.no_grad():
            return self._run(args, kwargs, target, losses, True, None, False)

    def _run(self, args, kwargs, target, losses, return_outputs, loss_kwargs, train):
        m, name = self._n_microbatches, type(self).__name__
        stages = {s.stage_index: s for s in self._stages}
        first, last = 0 in stages, self._stages[-1].is_last
        group = self._stages[0].group
        problem = None
        if losses is not None and not isinstance(losses, list):
            problem = MicroDDPError(f"{name}: losses must be a list, got "
                                    f"{type(losses).__name__}")
        elif first and not args:
            problem = MicroDDPError(f"{name}: the first stage's rank passes the batch: "
                                    "schedule.step(x)")
        elif first and not isinstance(args[0], torch.Tensor):
            problem = MicroDDPError(f"{name}: the batch's first argument must be a tensor, "
                                    f"not {type(args[0]).__name__}")
        elif last and train and target is None:
            problem = MicroDDPError(f"{name}: the last stage's rank passes the target: "
                                    "schedule.step(target=y)")
        # Every rank learns the batch size (only the first stage's rank has the batch) and
        # every refusal, at once: see step_check.py.
        agreement = start_agreement(
            group, name, problem, equal={"n_microbatches": m, "step": int(train)},
            known={"batch": len(args[0]) if first and problem is None else None,
                   "target": len(target) if last and target is not None and
                   hasattr(target, "__len__") else None},
            device=_meta_device(self._stages[0]))

        def agreed() -> int:
            told, _ = agreement.result()
            if told["target"] is not None and told["target"] != told["batch"]:
                raise MicroDDPError(f"{name}: the target has {told['target']} samples but the "
                                    f"batch {told['batch']}; pass the target of this very batch")
            microbatch_sizes(told["batch"], m)  # raises, alike on every rank, if n < m
            return told["batch"]

        # The first stage's rank knows the batch: while it stays the size the shapes were
        # learnt for, the agreement is waited for only before this rank's first message
        # (its round trip overlaps the first forward). Every other rank needs its answer now
        # (the last stage's, before its loss meets a target of a size not yet checked).
        steady = first and not last and problem is None and len(args[0]) == self._batch
        n = len(args[0]) if steady else agreed()
        sizes = microbatch_sizes(n, m)
        arg_mbs = [_split(a, m) for a in args] if first else []
        kwarg_mbs = {k: _split(a, m) for k, a in kwargs.items()}

        def kw(mb: int) -> dict:
            return {k: c[mb] for k, c in kwarg_mbs.items()}

        if self._batch != n:
            # the first step, or a batch of another size: the shapes are learnt (again)
            self._batch = None
            failed = infer(self._stages, tuple(c[0] for c in arg_mbs), kw(0), n, sizes[0],
                           self.program.rank_of)
            agree_step(group, f"{name}'s shape pass", failed, equal={},
                       device=_meta_device(self._stages[0]))
            self._batch = n
        targets = None if target is None else _split(target, m)
        outputs: list = [None] * m
        found: list = [None] * m
        lkw = loss_kwargs or {}

        def finish(out: torch.Tensor, mb: int):
            if return_outputs:
                outputs[mb] = out
            if self._loss_fn is not None and targets is not None:
                found[mb] = self._loss_fn(out, targets[mb], **lkw)
                return found[mb]
            return out

        def act_like(a: Action) -> tuple[torch.Tensor, ...]:
            stage = stages[a.stage]
            return tuple(torch.empty((sizes[a.mb], *shape[1:]) if by_batch else shape,
                                     dtype=dtype, device=stage.device)
                         for shape, dtype, by_batch in stage.input_meta)

        program = self.program if train else self.forward_program
        st = _Step(program, {i: s.submod for i, s in stages.items()}, self._stages[0].group,
                   self._stages[0].group_rank, lambda mb: tuple(c[mb] for c in arg_mbs),
                   finish, kwargs=kw, act_like=act_like, ready=agreed if steady else None)
        execute(st)
        st.settle()  # a program with no message (one rank) still ends with the agreement
        if train and self.scale_grads and m > 1:
            # as torch: the summed micro-batch gradients become their mean, after the last
            # backward (so a gradient left from before the step is divided too)
            for s in self._stages:
                for q in s.submod.parameters():
                    if q.grad is not None:
                        q.grad.div_(m)
        if last and losses is not None and found[0] is not None:
            losses.clear()
            losses.extend(found)
        if last and return_outputs:
            return _merge(outputs)
        return None


def _split(value, m: int) -> list:
    """`value` cut into m micro-batches along dim 0 if a tensor, else the same for all."""
    return list(value.tensor_split(m)) if isinstance(value, torch.Tensor) else [value] * m


def _merge(outputs: list):
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    if isinstance(outputs[0], tuple):
        return tuple(_merge(list(parts)) for parts in zip(*outputs, strict=True))
    return outputs


class _Single(_PipelineSchedule):
    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True) -> None:
        if not isinstance(stage, PipelineStage):
            raise MicroDDPError(f"{type(self).__name__} takes this rank's one PipelineStage; "
                                "for several per rank use ScheduleInterleaved1F1B")
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads)


class ScheduleGPipe(_Single):
    """GPipe: all forwards, then all backwards (microddp.pipeline.gpipe)."""

    def _build(self, p: int, m: int, v: int) -> Schedule:
        return gpipe(p, m)


class Schedule1F1B(_Single):
    """1F1B: warm-up forwards, then one forward and one backward in turn; any m >= 1."""

    def _build(self, p: int, m: int, v: int) -> Schedule:
        return one_f_one_b(p, m)


class _Multi(_PipelineSchedule):
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False) -> None:
        if not backward_requires_autograd:
            raise MicroDDPError(f"{type(self).__name__}: backward_requires_autograd=False is "
                                "not supported; the backward is autograd's")
        if not isinstance(stages, (list, tuple)):
            raise MicroDDPError(f"{type(self).__name__} takes a list of this rank's stages")
        super().__init__(list(stages), n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads)


class ScheduleInterleaved1F1B(_Multi):
    """Interleaved 1F1B over this rank's stages (microddp.pipeline.interleaved_1f1b); one
    stage per rank is plain 1F1B."""

    def _build(self, p: int, m: int, v: int) -> Schedule:
        return interleaved_1f1b(p, m, v) if v > 1 else one_f_one_b(p, m)


class ScheduleInterleavedZeroBubble(_Multi):
    """Zero bubble over this rank's stages: backward split into I and W, W filling idle
    slots (interleaved_zb.py; one stage per rank: microddp.pipeline.zero_bubble_h1)."""

    def _build(self, p: int, m: int, v: int) -> Schedule:
        return interleaved_zero_bubble(p, m, v) if v > 1 else zero_bubble_h1(p, m)


class ScheduleZBVZeroBubble(_Multi):
    """ZB-V: two stages per rank in a V, rank r holding r and 2p-1-r (zbv.py); rank 0 holds
    the first and the last stage, so it passes both the batch and the target."""

    def _build(self, p: int, m: int, v: int) -> Schedule:
        if v != 2:
            raise MicroDDPError(f"ScheduleZBVZeroBubble needs exactly 2 stages per rank "
                                f"(r and {2 * p - 1}-r on rank r), got {v}")
        return zbv_zero_bubble(p, m)
