"""PipelineStage: one stage of a pipeline, in torch.distributed.pipelining's shape.

    stage = PipelineStage(submodule, stage_index, num_stages, device, group=None)

A rank builds one (or, for interleaved schedules, several) and hands them to a schedule
(`microddp.pipeline.ScheduleGPipe`, ...), which checks that the rank holds the stages its
placement gives it (stage s on rank s % p, or ZB-V's V). What a rank cannot know before the
first step is the shape of the activations it receives: only the first stage's rank has the
batch. So the first step begins, as torch's does, with a metadata pass along the pipeline:
each stage runs its first micro-batch once without autograd and tells the next stage the shape
and dtype of its output (the batch size included). From then on every receive is posted with
a buffer of the right shape; a later step with another batch size is refused on the first
stage (build a new schedule for it). One tensor crosses each stage boundary (torch allows
tuples).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comms
from ..comms import distributed
from ..errors import MicroDDPError
from ..world.world import uses_nccl

# dtypes a boundary may carry, by their code in a metadata message
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16)
MAX_DIMS = 8
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
        self.input_meta: tuple[torch.Size, torch.dtype] | None = None  # micro-batch 0's input

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


def _shape_of(args) -> torch.Size:
    if isinstance(args, tuple):
        if len(args) != 1:
            raise MicroDDPError("PipelineStage: microddp passes one tensor between stages; "
                                f"got {len(args)} example tensors")
        args = args[0]
    return args.shape


def _encode(n: int, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise MicroDDPError(f"a pipeline stage must output one tensor to the next stage, "
                            f"not {type(t).__name__}; return a single tensor")
    if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
        raise MicroDDPError(f"a stage's output of shape {tuple(t.shape)} and {t.dtype} cannot "
                            f"cross a stage boundary (at most {MAX_DIMS} dims, dtypes {DTYPES})")
    shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
    return torch.tensor([n, t.dim(), DTYPES.index(t.dtype), *shape], dtype=torch.int64)


def _decode(msg: torch.Tensor) -> tuple[int, torch.Size, torch.dtype]:
    n, dims, code, *shape = msg.tolist()
    return n, torch.Size(shape[:dims]), DTYPES[code]


def infer(stages: list[PipelineStage], first_args: tuple, kwargs: dict, batch: int | None,
          rank_of) -> int:
    """The metadata pass: run each of this rank's stages on micro-batch 0 without autograd,
    in stage order, receiving the input's shape from the stage before (or building it on
    this rank) and telling the stage after. Sets each stage's `input_meta`; returns the batch
    size (every rank learns it from stage 0). Stages in increasing order on every rank and
    sends that do not block make it deadlock-free, as a forward pass is."""
    sends, out, n = [], None, batch
    group = stages[0].group
    where = _meta_device(stages[0])
    for stage in stages:
        s = stage.stage_index
        if s == 0:
            inputs = first_args
        else:
            if rank_of(s - 1) != stage.group_rank:
                msg = torch.empty(3 + MAX_DIMS, dtype=torch.int64, device=where)
                comms.recv(msg, group=group, tag=META_TAG + s, **_peer(group, rank_of(s - 1),
                                                                         "src"))
                n, shape, dtype = _decode(msg)
                stage.input_meta = (shape, dtype)
                out = torch.zeros(shape, dtype=dtype, device=stage.device)
            else:
                stage.input_meta = (out.shape, out.dtype)
            inputs = (out,)
            _check_user(stage, "input_args", out)
        # forked RNG: the pass must not shift the random numbers (dropout) of the real step
        devices = [stage.device] if stage.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            out = stage.submod(*inputs, **kwargs)
        if not stage.is_last:
            _check_user(stage, "output_args", out)
            msg = _encode(n, out).to(where)
            if rank_of(s + 1) != stage.group_rank:
                sends.append(comms.isend(msg, group=group, tag=META_TAG + s + 1,
                                         **_peer(group, rank_of(s + 1), "dst")))
    for handle in sends:
        handle.wait()
    return n


def _check_user(stage: PipelineStage, name: str, t: torch.Tensor) -> None:
    want = stage.user_shapes.get(name)
    if want is not None and tuple(want[1:]) != tuple(t.shape[1:]):
        raise MicroDDPError(f"stage {stage.stage_index}: {name} has shape {tuple(want)} but "
                            f"the model gives {tuple(t.shape)} (dims after the batch differ)")


def _meta_device(stage: PipelineStage) -> torch.device:
    """Where metadata messages live: NCCL moves only GPU tensors, gloo CPU ones."""
    nccl = distributed() and uses_nccl(stage.group)
    return stage.device if nccl else torch.device("cpu")


def _peer(group, rank: int, side: str) -> dict:
    return {side: rank} if group is None else {f"group_{side}": rank}
