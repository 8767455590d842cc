"""PipelineStage: one stage of a pipeline, in torch.distributed.pipelining's shape.

    stage = PipelineStage(submodule, stage_index, num_stages, device, group=None)

A rank builds one (or, for interleaved schedules, several) and hands them to a schedule
(`microddp.pipeline.ScheduleGPipe`, ...), which checks that the rank holds the stages its
placement gives it (stage s on rank s % p, or ZB-V's V). What a rank cannot know before the
first step is the shape of the activations it receives: only the first stage's rank has the
batch. So the first step begins, as torch's does, with a metadata pass along the pipeline:
each stage runs its first micro-batch once without autograd and tells the next stage the shape
and dtype of each tensor of its output: a stage may return one tensor or a tuple of them
(boundary.py), which the next stage takes as its positional arguments. From then on every
receive is posted with buffers of the right shapes. Every step starts with the ranks' agreement
(step_check.py), through which the batch size reaches every rank: when it changes, the pass
runs again, on every rank together, so a pipeline takes batches of any size.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comms
from ..comms import distributed
from ..errors import MicroDDPError
from ..world.world import uses_nccl
from .boundary import MAX_TENSORS, as_tuple

# dtypes a boundary may carry, by their code in a metadata message
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16)
MAX_DIMS = 8
META_WORDS = 2 + MAX_TENSORS * (2 + MAX_DIMS)  # one boundary's metadata message
META_TAG = 2**30  # above every tag the interpreter uses (see runtime._tag)


class PipelineStage:
    """Stage `stage_index` of `num_stages`: `submodule` on `device`, in process `group`.

    `input_args` / `output_args` are accepted for torch's signature and, when given, checked
    against the shapes the first step infers (their batch size is the micro-batch's)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str, input_args=None, output_args=None,
                 output_grads=None, input_grads=None, group=None, dw_builder=None,
                 get_mesh=None) -> None:
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise MicroDDPError(f"PipelineStage: {name} must be an int >= 0, got {value!r}")
        if not 0 <= stage_index < num_stages:
            raise MicroDDPError(f"PipelineStage: stage_index {stage_index} is out of range "
                                f"for {num_stages} stages (0..{num_stages - 1})")
        if dw_builder is not None or get_mesh is not None:
            raise MicroDDPError("PipelineStage: dw_builder and get_mesh are not supported; "
                                "the weight-gradient half (W) walks autograd's own graph")
        self.submod = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.device = torch.device(device)
        self.group = group
        self.group_rank = comms.group_rank(group)
        self.group_size = comms.group_size(group)
        if self.group_size > num_stages:
            raise MicroDDPError(f"PipelineStage: the group has {self.group_size} ranks but the "
                                f"pipeline only {num_stages} stages; every rank needs a stage")
        self.user_shapes = {k: _shape_of(v) for k, v in
                            (("input_args", input_args), ("output_args", output_args))
                            if v is not None}
        # per input tensor of micro-batch 0: (shape, dtype, whether dim 0 is the micro-batch)
        self.input_meta: list[tuple[torch.Size, torch.dtype, bool]] | None = None

    @property
    def is_first(self) -> bool:
        """Whether this stage reads the batch."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage's output meets the loss."""
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, {self.device})"


def _shape_of(args) -> tuple[torch.Size, ...]:
    return tuple(t.shape for t in as_tuple(args, "an example's args"))


def _encode(n: int, values: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The metadata message of one boundary: the batch size, then each tensor's rank, dtype
    and shape; n = -1 says the stage before failed (its rank's error says why)."""
    words = [n, 0 if values is None else len(values)]
    for t in values or ():
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        words += [t.dim(), DTYPES.index(t.dtype), *shape]
    return torch.tensor(words + [0] * (META_WORDS - len(words)), dtype=torch.int64)


def _check_crossing(values: tuple[torch.Tensor, ...]) -> None:
    for t in values:
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise MicroDDPError(f"a stage's output of shape {tuple(t.shape)} and {t.dtype} "
                                f"cannot cross a stage boundary (at most {MAX_DIMS} dims, "
                                f"dtypes {DTYPES})")


def _decode(msg: torch.Tensor) -> tuple[int, list[tuple[torch.Size, torch.dtype]]]:
    words = msg.tolist()
    n, k, metas = words[0], words[1], []
    for i in range(k):
        dims, code, *shape = words[2 + i * (2 + MAX_DIMS):2 + (i + 1) * (2 + MAX_DIMS)]
        metas.append((torch.Size(shape[:dims]), DTYPES[code]))
    return n, metas


def infer(stages: list[PipelineStage], first_args: tuple, kwargs: dict, batch: int, mb0: int,
          rank_of) -> Exception | None:
    """The metadata pass: run each of this rank's stages on micro-batch 0 without autograd,
    in stage order, receiving its inputs' shapes from the stage before (or building them on
    this rank) and telling the stage after. Sets each stage's `input_meta`: per input tensor
    (shape, dtype, whether dim 0 is the micro-batch's). Stages in increasing order on every
    rank and sends that do not block make it deadlock-free, as a forward pass is.

    A stage that fails (its forward, or an output that cannot cross) still sends a message,
    saying so, and the stages after it skip theirs: every rank finishes the pass, and the
    caller's agreement (step_check.py) turns the failure into one error on every rank. Returns
    this rank's own failure, or None. `mb0`: micro-batch 0's size; `rank_of(s)`: the group
    rank holding stage s."""
    sends, out, failed, problem = [], None, False, None
    group = stages[0].group
    where = _meta_device(stages[0])
    for stage in stages:
        s = stage.stage_index
        if s == 0:
            inputs = first_args
        elif rank_of(s - 1) != stage.group_rank:
            msg = torch.empty(META_WORDS, dtype=torch.int64, device=where)
            comms.recv(msg, group=group, tag=META_TAG + s, **_peer(group, rank_of(s - 1), "src"))
            n, metas = _decode(msg)
            failed = failed or n < 0
            inputs = tuple(torch.zeros(shape, dtype=dtype, device=stage.device)
                           for shape, dtype in metas)
        else:
            inputs = out
        if not failed:
            try:
                out = _run_stage(stage, inputs, kwargs, mb0)
            except MicroDDPError as error:
                problem, failed = error, True
            except Exception as error:  # anything the user's module raises: shared, then raised
                shown = [(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         for t in inputs if isinstance(t, torch.Tensor)]
                problem = MicroDDPError(f"stage {s}'s forward failed on micro-batch 0's "
                                        f"inputs {shown} in the shape pass: "
                                        f"{str(error).splitlines()[0] if str(error) else error!r}; "
                                        "build the same model on every rank")
                problem.__cause__, failed = error, True
        if not stage.is_last:
            msg = _encode(-1 if failed else batch, None if failed else out).to(where)
            if rank_of(s + 1) != stage.group_rank:
                sends.append(comms.isend(msg, group=group, tag=META_TAG + s + 1,
                                         **_peer(group, rank_of(s + 1), "dst")))
    for handle in sends:
        handle.wait()
    return problem


def _run_stage(stage: PipelineStage, inputs: tuple, kwargs: dict, mb0: int) -> tuple:
    """One stage's part of the metadata pass: its forward on `inputs`; returns its output."""
    if stage.stage_index > 0:
        stage.input_meta = [(t.shape, t.dtype, t.dim() >= 1 and t.shape[0] == mb0)
                            for t in inputs]
        _check_user(stage, "input_args", inputs)
    # forked RNG: the pass must not shift the random numbers (dropout) of the real step
    devices = [stage.device] if stage.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        out = stage.submod(*inputs, **kwargs)
    if stage.is_last:
        return ()
    out = as_tuple(out, f"stage {stage.stage_index}'s output")
    _check_crossing(out)
    _check_user(stage, "output_args", out)
    return out


def _check_user(stage: PipelineStage, name: str, values: tuple[torch.Tensor, ...]) -> None:
    want = stage.user_shapes.get(name)
    got = tuple(t.shape for t in values)
    if want is not None and (len(want) != len(got) or any(
            tuple(w[1:]) != tuple(g[1:]) for w, g in zip(want, got, strict=True))):
        raise MicroDDPError(f"stage {stage.stage_index}: {name} has shapes "
                            f"{[tuple(w) for w in want]} but the model gives "
                            f"{[tuple(g) for g in got]} (dims after the batch differ)")


def _meta_device(stage: PipelineStage) -> torch.device:
    """Where metadata messages live: NCCL moves only GPU tensors, gloo CPU ones."""
    nccl = distributed() and uses_nccl(stage.group)
    return stage.device if nccl else torch.device("cpu")


def _peer(group, rank: int, side: str) -> dict:
    return {side: rank} if group is None else {f"group_{side}": rank}
