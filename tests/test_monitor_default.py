"""The monitor microddp.init() starts by default: on, off, its threshold, its clean stop, and
the report a plain script gets from `microddp run` when it hangs."""

import pytest

import microddp as mdp
from launch_helpers import microddp, write
from microddp import monitor
from microddp.monitor.hang import find_report


def _state(rank, flag):
    import os

    import torch

    world = mdp.init(timeout=20, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                     monitor=flag)
    mon = monitor.active()
    seen = None if mon is None else (mon.timeout_s, mon._thread.is_alive(), mon.interrupt)
    mdp.comms.all_reduce(torch.ones(1))
    mdp.shutdown()
    stopped = mon is None or not mon._thread.is_alive()
    return world.rank, seen, monitor.active() is None, stopped


@pytest.mark.parametrize("flag", [None, False])
def test_init_starts_the_monitor_unless_told_not_to_and_shutdown_joins_it(flag):
    out = mdp.spawn(_state, 2, args=(flag,), join=False, timeout=90)
    # 20 s process group: asked at 16 s; its waits are left to the group (nothing interrupted)
    seen = (16.0, True, False) if flag is None else None
    assert out == [(0, seen, True, True), (1, seen, True, True)]


def _implicit(rank, how):
    import torch

    if how == "comms":  # never calls mdp.init(): the first collective forms the world
        mdp.comms.all_reduce(torch.ones(4))
    else:  # a DDP built first, as a script that swaps torch's DDP for microddp's does
        mdp.DDP(torch.nn.Linear(2, 2))
    on = monitor.active() is not None
    mdp.shutdown()
    return on, monitor.active() is None


@pytest.mark.parametrize("how", ["comms", "ddp"])
def test_a_world_formed_without_init_gets_the_monitor_too(how):
    """A script that never calls mdp.init() forms its group on its first collective (RANK
    and WORLD_SIZE from the launcher): the hang monitor starts then as init() starts it. It
    did not after the layout change of issue 45 (the bottom layer formed the group alone)."""
    out = mdp.spawn(_implicit, 2, args=(how,), join=False, timeout=90)
    assert out == [(True, True), (True, True)]


def test_the_switch_and_the_threshold(monkeypatch):
    monkeypatch.delenv("MICRODDP_MONITOR", raising=False)
    assert monitor.wanted(None) is True
    for off in ("0", "off", "False"):
        monkeypatch.setenv("MICRODDP_MONITOR", off)
        assert monitor.wanted(None) is False
        assert monitor.wanted(True) is True  # the argument wins
    monkeypatch.setenv("MICRODDP_MONITOR", "maybe")
    with pytest.raises(mdp.MicroDDPError, match="MICRODDP_MONITOR='maybe' is neither on nor off"):
        monitor.wanted(None)
    # 8 s below the process group's timeout, or a fifth of a short one
    assert [monitor.stall_seconds(t) for t in (10, 40, 60, 120, 1800)] == [8, 32, 52, 112, 1792]
    # Waiting with the monitor's own timeout pays only far below the group's (or unknown)
    assert [monitor.interrupt_pays(monitor.stall_seconds(t), t) for t in (10, 41.3, 1800)] == [
        False, False, False]
    assert monitor.interrupt_pays(2, 60) and monitor.interrupt_pays(60, None)
    assert not monitor.interrupt_pays(60, 0.0)  # no gloo side: nothing to interrupt


def save_checkpoint(seconds):
    import time

    time.sleep(seconds)  # LINE-SAVE


def _blocking_hang(rank):
    import os
    import time

    import torch
    import torch.distributed as dist

    world = mdp.init(timeout=6, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    t = torch.ones(4)
    dist.all_reduce(t)
    if world.rank == 1:
        save_checkpoint(9)  # rank 0 stalls at 4.8 s, gloo ends its wait at 6 s
        mdp.shutdown()
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)  # LINE-BLOCKING: torch's own blocking call, as a torch script has it
    except mdp.MicroDDPError as e:
        return str(e), time.monotonic() - t0, monitor.active().interrupt
    return "no error"


def test_a_blocking_torch_call_is_reported_then_ended_by_gloo_in_a_micro_ddp_error():
    text, took, interrupt = mdp.spawn(_blocking_hang, 2, join=False, timeout=90)[0]
    assert interrupt is False
    assert text.startswith("microddp hang report: collective all_reduce #2 on rank 0 did not "
                           "complete within 4.8 s"), text
    lines = text.splitlines()
    assert lines[1] == ("  rank 0 is in all_reduce #2 (float32[4] sum) called from "
                        f"_blocking_hang at test_monitor_default.py:{_here('LINE-BLOCKING')}")
    assert lines[2] == (f"  rank 1 is in save_checkpoint at test_monitor_default.py:"
                        f"{_here('LINE-SAVE')} (not in a collective; last collective all_reduce #1)")
    assert took >= 5.5  # ended by gloo's own (6 s) timeout, not earlier by the monitor


def _here(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if f"# {marker}" in line)


def _leaves_no_tensor_behind(world):
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    mon = monitor.active()
    refs = []
    for async_op in (False, True):
        t = torch.ones(1 << 16)
        refs.append(weakref.ref(t))
        work = dist.all_reduce(t, async_op=async_op)
        if work is not None:
            work.wait()
        del t, work
    # An async call's entry holds torch's own Work (never a wrapper: torch's C++ takes it)
    # until the watchdog sees it complete, within one of its polls.
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(e.done is None for e in list(mon.log.recent)[-2:]):
        time.sleep(0.05)
    gc.collect()
    return mon.interrupt, [r() is None for r in refs], [e.done is not None for e in
                                                        list(mon.log.recent)[-2:]]


def test_the_log_of_init_s_monitor_keeps_no_tensor_alive_after_its_call():
    for out in mdp.spawn(_leaves_no_tensor_behind, 2, timeout=60):
        # spawn's 60 s group and init's 52 s threshold: the monitor init() starts
        assert out == (False, [True, True], [True, True])


REPORT = [
    "microddp hang report: collective all_reduce #2 on rank 0 did not complete within 8 s",
    "  rank 0 is in all_reduce #2 (float32[4] sum) called from <module> at hang.py:17",
    "  rank 1 is in save_checkpoint_slowly at hang.py:9 (not in a collective)",
    "fix: every rank must call the same collectives in the same order",
]


def test_find_report_in_a_traceback_and_in_the_watchdogs_print():
    traceback = ["[rank0]: Traceback (most recent call last):",
                 '[rank0]:   File "hang.py", line 17, in <module>',
                 f"[rank0]: microddp.errors.MicroDDPError: {REPORT[0]}",
                 *(f"[rank0]: {line}" for line in REPORT[1:]),
                 "[rank0]: something after"]
    assert find_report(traceback) == REPORT
    watchdog = ["step 3", f"[rank 0] {REPORT[0]}", *REPORT[1:], "[rank 0] ending this process"]
    assert find_report(watchdog) == REPORT
    assert find_report(["Timed out waiting 10000ms for recv operation"]) == []


HANG = """
    import time

    import torch

    import microddp as mdp


    def save_checkpoint_slowly():
        time.sleep(40)  # LINE-SLEEP


    world = mdp.init(timeout=10)
    t = torch.ones(4)
    mdp.comms.all_reduce(t)
    if world.rank == 1:
        save_checkpoint_slowly()
    mdp.comms.all_reduce(t)  # LINE-STUCK
    mdp.shutdown()
"""


def _line(marker):
    return next(i for i, line in enumerate(HANG.splitlines(), 1) if marker in line)


def test_a_plain_script_that_hangs_gets_the_report_first(tmp_path):
    script = write(tmp_path, "hang.py", HANG)
    out = microddp("run", "-n", "2", script, timeout=90)
    assert out.returncode == 1, out.stderr
    summary = out.stderr[out.stderr.index("microddp run: rank"):].splitlines()
    assert summary[0].endswith("after a hang; stopped the other ranks. The monitor's report:")
    assert summary[1].startswith("  microddp hang report: collective all_reduce #2 on rank 0 "
                                 "did not complete within 8 s")
    assert summary[2:4] == [
        f"    rank 0 is in all_reduce #2 (float32[4] sum) called from <module> at "
        f"hang.py:{_line('LINE-STUCK')}",
        f"    rank 1 is in save_checkpoint_slowly at hang.py:{_line('LINE-SLEEP')} (not in a "
        "collective; last collective all_reduce #1)"]
    assert summary[4].startswith("    Flight Recorder dumps in ")  # monitor/flight.py
    assert summary[5].startswith("  fix: ")
    assert summary[6] == "microddp run: rank 0's output. Its last lines:"  # the traceback: after


BACKEND_FIRST = """
    import os
    import time

    import torch

    import microddp as mdp


    def save_checkpoint_slowly():
        time.sleep(40)  # LINE-SLEEP


    os.environ["MICRODDP_TRANSPORT"] = "gloo"  # gloo's own timeout (shared memory has its own)
    world = mdp.init(timeout=5, monitor=False)
    mdp.monitor.enable(timeout=60)  # far above the group's 5 s: gloo gives up first
    model = mdp.DistributedDataParallel(torch.nn.Linear(4, 4))
    HOOK
    if world.rank == 1:
        save_checkpoint_slowly()
    model(torch.ones(2, 4)).sum().backward()  # LINE-STUCK
    mdp.shutdown()
"""


@pytest.mark.parametrize("hook", [None, "fp16_compress"])
def test_a_wait_the_backend_ends_first_still_names_the_call_and_the_ranks(tmp_path, hook):
    """DDP's bucket waits on an async Work (or, with a comm hook, on a future chained to
    one); the group's timeout (5 s) ends it long before the monitor's threshold (60 s). The
    report names the failed call (it has already left the calls in flight) and says it timed
    out in the backend's words, not within the monitor's 60 s; the rank is placed at the
    user's line, not in the glue a failed wait goes through (comms/handle.py,
    monitor/patch.py)."""
    register = f"model.register_comm_hook(None, {hook!r})" if hook else "pass"
    script = write(tmp_path, "hang.py", BACKEND_FIRST.replace("HOOK", register))
    out = microddp("run", "-n", "2", script, timeout=120)
    assert out.returncode == 1, out.stderr
    # the launcher's summary shows the report first, each line indented by two spaces
    summary = out.stderr[out.stderr.index("The monitor's report:"):].splitlines()[1:4]
    report = [line[2:] for line in summary]
    assert report[0].startswith("microddp hang report: collective all_reduce #"), report
    assert " on rank 0 timed out (Timed out waiting 5000ms" in report[0], report
    lines = BACKEND_FIRST.splitlines()
    stuck = next(i for i, line in enumerate(lines, 1) if "LINE-STUCK" in line)
    sleep = next(i for i, line in enumerate(lines, 1) if "LINE-SLEEP" in line)
    assert report[1].startswith("  rank 0 is in all_reduce #"), report
    assert report[1].endswith(f"under <module> at hang.py:{stuck}"), report
    assert report[2].startswith(f"  rank 1 is in save_checkpoint_slowly at hang.py:{sleep} "), \
        report
    assert "__init__.py" not in "\n".join(report), report


CLEAN = """
    import torch

    import microddp as mdp

    world = mdp.init(timeout=30)
    t = torch.ones(1024) * world.rank
    for _ in range(3):
        mdp.comms.all_reduce(t)
    assert mdp.monitor.active() is not None
    print("sum", t[0].item())
    mdp.shutdown()
"""


def _back_to_back(tmp_path, runs):
    script = write(tmp_path, "clean.py", CLEAN)
    bad = []
    for i in range(runs):
        out = microddp("run", "-n", "2", script, timeout=120)
        if out.returncode != 0 or sorted(out.stdout.splitlines()) != [
                "[rank 0] sum 4.0", "[rank 1] sum 4.0"]:
            bad.append((i, out.returncode, out.stdout[-300:], out.stderr[-600:]))
    assert bad == []


@pytest.mark.slow  # runs back to back: a stress test
def test_back_to_back_runs_with_the_monitor_on_exit_0(tmp_path):
    _back_to_back(tmp_path, 3)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 10 s a run on a busy 2-core machine
def test_30_back_to_back_runs_with_the_monitor_on_exit_0(tmp_path):
    _back_to_back(tmp_path, 30)
