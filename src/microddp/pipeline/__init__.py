"""Pipeline parallelism: a model cut into stages, schedules as data, and one interpreter.

    from microddp import pipeline
    stages = pipeline.split_model(model, p)              # one slice of layers per stage
    schedule = pipeline.build("1f1b", p, m)              # every rank's program, as data
    pipeline.validate(schedule)                          # checked before anything runs
    print(pipeline.grid(schedule))                       # the rank x time picture
    loss = pipeline.run_schedule(schedule, {rank: stages[rank]}, x, y, loss_fn)

Hybrid DP x PP: `Replicated` wraps a rank's stages in DDP over their data-parallel group.
torch.distributed.pipelining's shape: `PipelineStage` and `ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`
(schedule_classes.py), the same schedules and interpreter underneath.
"""

from . import placement
from .hybrid import Replicated
from .interleaved_zb import interleaved_zero_bubble
from .runtime import microbatch_sizes, run_schedule
from .schedule_classes import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from .schedules import (
    BUILDERS,
    Action,
    Schedule,
    build,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from .simulate import Timeline, grid, simulate, theory_bubble
from .split import blocks_per_stage, split_model, stage_bounds, stage_parameter_names
from .stage import PipelineStage
from .validate import validate
from .zbv import zbv_zero_bubble

__all__ = ["BUILDERS", "Action", "PipelineStage", "Replicated", "Schedule", "Schedule1F1B",
           "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "Timeline", "blocks_per_stage", "build", "forward_only",
           "gpipe", "grid", "interleaved_1f1b", "interleaved_zero_bubble", "microbatch_sizes",
           "placement", "one_f_one_b", "run_schedule", "simulate", "split_model",
           "stage_bounds", "stage_parameter_names", "theory_bubble", "validate",
           "zbv_zero_bubble", "zero_bubble_h1"]
