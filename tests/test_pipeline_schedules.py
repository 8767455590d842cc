"""Schedules as data, without a single message: the split, every builder for many (p, m),
the grid, the bubble on paper, and the validator on schedules broken one rule at a time."""

import dataclasses

import pytest
import torch

import microddp as mdp
from microddp import MicroDDPError, pipeline
from microddp.pipeline import Action, Schedule

# --- the split -------------------------------------------------------------------------------


@pytest.mark.parametrize("depth,p,expected", [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]),
                                              (3, 3, [1, 1, 1]), (8, 1, [8])])
def test_split_gives_the_extra_blocks_to_the_first_stages(depth, p, expected):
    assert pipeline.blocks_per_stage(depth, p) == expected


@pytest.mark.parametrize("depth,p", [(1, 1), (5, 2), (7, 3), (6, 6), (9, 4)])
def test_the_stages_in_order_are_the_model(depth, p):
    torch.manual_seed(0)
    model = mdp.FullMLP(6, depth)
    stages = pipeline.split_model(model, p)
    x = torch.randn(5, 6)
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(x))
    held = [id(q) for s in stages for q in s.parameters()]
    assert sorted(held) == sorted(id(q) for q in model.parameters())  # none dropped or repeated
    names = [n for s in range(p) for n in pipeline.stage_parameter_names(model, p, s)]
    assert names == [n for n, _ in model.named_parameters()]


def test_more_stages_than_blocks_is_refused_saying_what_to_do():
    with pytest.raises(MicroDDPError, match=r"depth 3 into 4 stages.*at most 3 stages"):
        pipeline.split_model(mdp.FullMLP(4, 3), 4)


# --- the builders ----------------------------------------------------------------------------

GRID = [(name, p, m, v) for name in pipeline.BUILDERS for p in range(1, 6) for m in range(1, 10)
        for v in ((2, 3) if name == "interleaved" else (1,))]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_every_built_schedule_is_valid(name, p, m, v):
    schedule = pipeline.build(name, p, m, v)
    pipeline.validate(schedule)
    computes = [a for prog in schedule.actions for a in prog if a.kind in ("F", "B", "I", "W")]
    per_pair = 3 if name == "zero-bubble" else 2
    assert len(computes) == per_pair * p * v * m


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 3)])
def test_gpipe_and_1f1b_bubble_on_paper_is_the_textbook_one(name, p, m):
    timeline = pipeline.simulate(pipeline.build(name, p, m))
    assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert timeline.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_interleaving_and_zero_bubble_shrink_the_bubble(p, m):
    bubble = {n: pipeline.simulate(pipeline.build(n, p, m)).bubble for n in pipeline.BUILDERS}
    for name in ("interleaved", "zero-bubble"):
        theory = pipeline.theory_bubble(pipeline.build(name, p, m))
        assert bubble[name] == pytest.approx(theory)
        assert bubble[name] < bubble["1f1b"]


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    def peak(schedule, rank):
        held = most = 0
        for a in schedule.actions[rank]:
            held += {"F": 1, "B": -1}.get(a.kind, 0)
            most = max(most, held)
        return most

    gpipe, one_f = pipeline.build("gpipe", 4, 8), pipeline.build("1f1b", 4, 8)
    assert [peak(gpipe, r) for r in range(4)] == [8, 8, 8, 8]
    assert [peak(one_f, r) for r in range(4)] == [4, 3, 2, 1]


def test_grid_is_the_classic_picture():
    assert pipeline.grid(pipeline.build("gpipe", 2, 2)) == (
        "rank 0 | F0 F1 .  .  .  B0 B0 B1 B1\n"
        "rank 1 | .  F0 F1 B0 B0 B1 B1 .  .")
    assert pipeline.grid(pipeline.build("1f1b", 2, 2)) == (
        "rank 0 | F0 F1 .  .  B0 B0 .  B1 B1\n"
        "rank 1 | .  F0 B0 B0 F1 B1 B1 .  .")


@pytest.mark.parametrize("args,match", [(("gpipe", 0, 2), "ranks"), (("1f1b", 2, 0), "micro"),
                                        (("interleaved", 2, 2, 1), "v >= 2"),
                                        (("pipedream", 2, 2), "unknown pipeline schedule")])
def test_bad_arguments_say_what_to_do(args, match):
    with pytest.raises(MicroDDPError, match=match):
        pipeline.build(*args)


# --- the validator on broken schedules --------------------------------------------------------


def edit(schedule: Schedule, rank: int, change) -> Schedule:
    programs = [list(p) for p in schedule.actions]
    programs[rank] = change(programs[rank])
    return dataclasses.replace(schedule, actions=tuple(tuple(p) for p in programs))


def find(program, kind, mb, stage=None):
    return next(i for i, a in enumerate(program)
                if a.kind == kind and a.mb == mb and (stage is None or a.stage == stage))


def swap(i, j):
    def change(program):
        program[i], program[j] = program[j], program[i]
        return program
    return change


def remove(kind, mb):
    return lambda program: [a for a in program if not (a.kind == kind and a.mb == mb)]


def replace(what, which, **fields):
    return lambda program: [dataclasses.replace(a, **fields) if (a.kind, a.mb) == (what, which)
                            else a for a in program]


G, Z = pipeline.build("gpipe", 2, 3), pipeline.build("zero-bubble", 2, 3)
G1, G2 = pipeline.build("gpipe", 1, 1), pipeline.build("gpipe", 2, 2)
BROKEN = [
    # rule, schedule, the rank changed, the change, the rank and action the error names
    ("well formed", G, 0, replace("F", 1, stage=1), 0, "F(stage 1, micro-batch 1)"),
    ("well formed", G, 1, replace("B", 2, mb=7), 1, "B(stage 1, micro-batch 7)"),
    ("complete", G, 1, lambda p: p + [Action(1, "F", 0, 1)], 1, "F(stage 1, micro-batch 0)"),
    ("complete", G, 0, remove("B", 2), 0, "stage 0 runs B or I for 2 of 3 micro-batches"),
    ("micro-batches in order", G, 0, swap(find(G.actions[0], "F", 0), find(G.actions[0], "F", 1)),
     0, "F(stage 0, micro-batch 1)"),
    ("input before forward", G, 1,
     swap(find(G.actions[1], "RECV_ACT", 0), find(G.actions[1], "F", 0)), 1,
     "F(stage 1, micro-batch 0)"),
    ("forward before backward", G1, 0, swap(0, 1), 0, "B(stage 0, micro-batch 0)"),
    ("gradient before backward", G, 0,
     swap(find(G.actions[0], "RECV_GRAD", 0), find(G.actions[0], "B", 0)), 0,
     "B(stage 0, micro-batch 0)"),
    ("W after I", Z, 1, swap(find(Z.actions[1], "I", 0), find(Z.actions[1], "W", 0)), 1,
     "W(stage 1, micro-batch 0)"),
    ("send after compute", G, 0,
     swap(find(G.actions[0], "F", 0), find(G.actions[0], "SEND_ACT", 0)), 0,
     "SEND_ACT(stage 0, micro-batch 0)"),
    ("matched", G, 1, remove("SEND_GRAD", 1), 0, "RECV_GRAD(stage 0, micro-batch 1)"),
    ("matched", G, 0, lambda p: p + [Action(0, "SEND_ACT", 0, 0)], 0,
     "SEND_ACT(stage 0, micro-batch 0)"),
    ("matched", G, 0, replace("SEND_ACT", 0, kind="SEND_GRAD"), 0,
     "SEND_GRAD(stage 0, micro-batch 0)"),
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activation,
    # which rank 1 waits for before it computes that gradient
    ("no deadlock", G2, 0, lambda p: [p[0], p[1], p[2], p[4], p[5], p[3], p[6], p[7]], 0,
     "RECV_GRAD(stage 0, micro-batch 0)"),
]


@pytest.mark.parametrize("rule,schedule,rank,change,named,action", BROKEN,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_each_rule_broken_once_is_named_with_its_rank_and_action(rule, schedule, rank, change,
                                                                 named, action):
    pipeline.validate(schedule)  # the schedule was fine before the change
    with pytest.raises(MicroDDPError) as err:
        pipeline.validate(edit(schedule, rank, change))
    message = str(err.value)
    assert f"rule '{rule}' broken" in message
    assert f"rank {named}" in message and action in message, message


def test_previous_stage_first_is_checked_on_the_played_timeline():
    # A hand-made timeline where stage 1 starts before stage 0 has finished: the other rules
    # cannot see it, because the actions alone (no messages between the stages) are well formed.
    s = pipeline.build("gpipe", 2, 1)
    timeline = pipeline.simulate(s)
    start, end, a = timeline.spans[1][0]
    timeline.spans[1][0] = (0.5, 1.5, a)
    from microddp.pipeline.validate import _check_causality

    with pytest.raises(MicroDDPError, match=r"rank 1, action 1 F\(stage 1, micro-batch 0\): "
                                            r"rule 'previous stage first' broken"):
        _check_causality(s, timeline)


def test_micro_batches_of_an_uneven_batch_are_never_larger_at_the_end():
    assert pipeline.microbatch_sizes(11, 5) == [3, 2, 2, 2, 2]
    assert pipeline.microbatch_sizes(11, 2) == [6, 5]
    assert pipeline.microbatch_sizes(12, 4) == [3, 3, 3, 3]
    with pytest.raises(MicroDDPError, match="cannot cut a batch of 3 samples into 5"):
        pipeline.microbatch_sizes(3, 5)
