"""torch's error types and phrases, and torch's logging sample rate (issue 50): each case run
on microddp's and PyTorch's DistributedDataParallel in the same ranks, and the results
compared. An error must be an instance of the type torch raises there, contain torch's
message, and still be a MicroDDPError (with microddp's advice after torch's words)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import microddp as mdp
from microddp import MicroDDPError

ENGINES = ("microddp", "torch")


def make(engine, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    cls = mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel
    return cls(model, **kwargs)


def step(ddp, world, k):
    g = torch.Generator().manual_seed(10 * k + world.rank)
    ddp(torch.randn(4, 6, generator=g)).sum().backward()


def allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()),
                           async_op=True).get_future().then(lambda f: f.value()[0])


def bad_bucket(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return allreduce_hook(state, bucket)


def bad_return(state, bucket: dist.GradBucket) -> int:
    return 1


def returns_int(state, bucket):
    return 1


def raised(fn):
    """The types (torch's builtin ones, and whether a MicroDDPError) and the message."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the point is which type it is
        kinds = sorted(t.__name__ for t in (TypeError, ValueError, RuntimeError)
                       if isinstance(e, t))
        return kinds, isinstance(e, MicroDDPError), str(e)
    return None


def errors(world, engine):
    out = {}
    out["not callable"] = raised(lambda: make(engine).register_comm_hook(None, 1))
    out["bucket annotation"] = raised(lambda: make(engine).register_comm_hook(None, bad_bucket))
    out["return annotation"] = raised(lambda: make(engine).register_comm_hook(None, bad_return))

    def twice():
        ddp = make(engine)
        ddp.register_comm_hook(None, allreduce_hook)
        ddp.register_comm_hook(None, allreduce_hook)
    out["twice"] = raised(twice)

    def returns_not_a_future():
        ddp = make(engine)
        ddp.register_comm_hook(None, returns_int)
        step(ddp, world, 0)
    out["returns int"] = raised(returns_not_a_future)

    def late_static():
        ddp = make(engine)
        step(ddp, world, 0)
        ddp._set_static_graph()
    out["late static graph"] = raised(late_static)
    out["sample rate 0"] = raised(lambda: make(engine)._set_ddp_runtime_logging_sample_rate(0))
    return out


def logging(world, engine, rate):
    """`iteration` and whether the times are there, after each of 24 iterations."""
    ddp = make(engine)
    if rate is not None:
        ddp._set_ddp_runtime_logging_sample_rate(rate)
    seen = []
    for k in range(24):
        step(ddp, world, k)
        data = ddp._get_ddp_logging_data()
        seen.append((data.get("iteration"), data.get("forward_compute_time", 0) > 0,
                     data.get("backward_comm_time", 0) > 0))
    return seen


def both(world):
    return ({e: errors(world, e) for e in ENGINES},
            {rate: {e: logging(world, e, rate) for e in ENGINES} for rate in (2, 3, None)})


def test_errors_are_torchs_types_with_torchs_words_and_logging_samples_as_torch():
    for errs, logs in mdp.spawn(both, 2, timeout=180):
        ours, theirs = errs["microddp"], errs["torch"]
        assert set(ours) == set(theirs) == {
            "not callable", "bucket annotation", "return annotation", "twice", "returns int",
            "late static graph", "sample rate 0"}
        for case in ours:
            assert theirs[case] is not None, case  # torch raises in every case
            (our_kinds, our_mdp, _), (their_kinds, _, _) = ours[case], theirs[case]
            assert set(their_kinds) <= set(our_kinds), (case, our_kinds, their_kinds)
            assert our_mdp, case
        # torch's phrase is in ours (torch prefixes its own messages with context, so the
        # phrase torch's tests match is compared, not the whole message)
        phrases = {"not callable": "Communication hook must be callable.",
                   "bucket annotation": "bucket annotation should be dist.GradBucket.",
                   "return annotation": "return annotation should be torch.futures.Future",
                   "twice": "register_comm_hook or register_builtin_comm_hook can only be "
                            "called once",
                   "returns int": "callback must return a torch.futures.Future object, but got",
                   "late static graph": "should be called before training loop starts",
                   "sample rate 0": "DDP runtime logging sample rate should be equal or greater "
                                    "than 1"}
        for case, phrase in phrases.items():
            assert phrase in theirs[case][2], (case, theirs[case][2])
            assert phrase in ours[case][2], (case, ours[case][2])
        for rate, runs in logs.items():
            assert runs["microddp"] == runs["torch"], rate


def test_a_hook_annotated_with_strings_or_microddps_bucket_is_accepted():
    from microddp.dp.comm_hooks import BUILTIN, GradBucket, check_hook

    def ours(state, bucket: GradBucket) -> torch.futures.Future:
        return bucket

    def strings(state, bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
        return bucket

    for hook in (ours, strings, *BUILTIN.values()):
        check_hook(hook)
    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
        check_hook(bad_bucket)
