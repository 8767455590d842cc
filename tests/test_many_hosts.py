"""The README's many-hosts commands, run as written on "hosts" made of network namespaces
(tests/netns_helpers.py): each has its own loopback, its hostname resolves to 127.0.0.1, and
no interface variable is set, so microddp must find the interface that reaches the others by
itself. The results must equal one host's, and a host that advertises the loopback to the
other must end in one clear line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import netns_helpers
from microddp import checkpoint
from microddp.monitor.hang import find_report

ROOT = Path(__file__).resolve().parents[1]
REASON = netns_helpers.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
DEADLINE = 600
HOST = socket.gethostname()  # the same in every namespace: `ip netns` keeps the UTS namespace


def readme_commands() -> list[str]:
    """The torchrun commands of the README's "Many hosts" section, continuations joined, as
    the shell reads them ($HOST0 and friends expanded by bash when they run)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Many hosts", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        joined = block.replace("\\\n", " ")
        commands += [" ".join(line.split()) for line in joined.splitlines()
                     if re.match(r"\s*([A-Z_]+=\S+ )*torchrun ", line)]
    return commands


def _env(net: netns_helpers.Fabric, host: int, **extra: str) -> dict:
    """A user's environment on host `host`: no interface variable, no rank variables."""
    drop = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "MICRODDP_HIERARCHICAL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HOST0=net.addrs[0], NODE_RANK=str(host), THIS_HOST=net.addrs[host], **extra)
    return env


def _start(net, host: int, command: str, cwd: Path, **extra: str) -> subprocess.Popen:
    return net.popen(host, ["bash", "-c", command], cwd=cwd, env=_env(net, host, **extra),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = DEADLINE) -> list[str]:
    deadline = time.monotonic() + timeout
    return [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]


def _params(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _one_host(tmp: Path, nproc: int = 4) -> dict:
    """The same job on one host with 4 ranks (the loopback, no namespace)."""
    out = subprocess.run([sys.executable, "-m", "microddp", "train", "--nproc", str(nproc),
                          "--out", str(tmp / "one-host")], capture_output=True, text=True,
                         timeout=DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    return _params(tmp / "one-host" / "model.pt")


def test_the_readme_has_the_commands_these_tests_run():
    static, c10d_host0, c10d_other = readme_commands()
    assert "--master-addr $HOST0" in static and "--node-rank $NODE_RANK" in static
    assert "--rdzv-conf is_host=1" in c10d_host0 and "is_host" not in c10d_other
    assert "--local-addr $HOST0" in c10d_host0 and "--local-addr $THIS_HOST" in c10d_other
    assert all(c.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ")
               for c in (c10d_host0, c10d_other))


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The README's static command on 2 namespaces x 2 ranks, and the one-host reference."""
    tmp = tmp_path_factory.mktemp("two-hosts")
    static = readme_commands()[0]
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, static, tmp) for h in range(2)]
        logs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    reference = _one_host(tmp)
    return tmp, logs, reference


def test_two_hosts_by_the_readme_match_one_host(two_hosts):
    tmp, logs, reference = two_hosts
    # the interface was found by itself: the one that routes to host 0's address
    assert ("microddp: 2 host(s) reach each other (mddp0, the route to MASTER_ADDR "
            f"10.213.0.1): {HOST} 10.213.0.1 (ranks 0,1), {HOST} 10.213.0.2 (ranks 2,3)"
            ) in logs[0]
    got = _params(tmp / "runs" / "two-hosts" / "model.pt")
    # Hierarchical all-reduce across the hosts adds in another order than one host's flat
    # one: equal to rounding, as the 1-rank vs N-rank comparisons of test_train.py.
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.allclose(got[k], reference[k], rtol=0, atol=2e-5), \
            (k, (got[k] - reference[k]).abs().max())


class Output:
    """A process's output, read line by line as it comes (a test waits for a line in it)."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(p,), daemon=True)
        self._thread.start()

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, p: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline and p.poll() is None, self.text()
            time.sleep(0.1)

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(self.lines)


def _lose(net, host: int, how: str) -> None:
    """Host `host` dies: its processes killed ("killed": the kernel closes their connections,
    so the others see them go at once) or its link cut first ("link down": nothing reaches
    the others, as when a machine loses power; they only notice by timing out)."""
    if how == "link down":
        net.ip(host, "link", "set", netns_helpers.IFNAME, "down")
    assert net.kill_host(host), f"host {host} had no process to kill"


# The process group's timeout in the runs that lose a host by its link: gloo's waits end then
# (and the sub-groups' too, formed with the world's timeout, not torch's 30 minutes).
LINK_TIMEOUT = "30"


@pytest.mark.parametrize("how", ["killed", "link down"])
def test_a_lost_host_rejoins_and_the_run_ends_as_if_never_interrupted(two_hosts, tmp_path, how):
    """The README's elastic commands; once the first checkpoint is written, host 1 is lost
    (every process killed, its link cut first in the second case) and the same command is
    started there again. Host 0's torchrun restarts its workers, both hosts meet in the next
    rendezvous round, and the job resumes from the checkpoint to the same parameters as the
    uninterrupted run of the static command across the same two hosts, bit for bit. With the
    link cut, host 1 comes back only once host 0's ranks have given up on it with the hang
    report naming host 1's ranks (before the fix, their waits on the hierarchical all-reduce
    ran for torch's 30 minutes, outside the monitor's sight)."""
    _, c10d_host0, c10d_other = readme_commands()
    ckpts = tmp_path / "runs" / "elastic" / "checkpoints"
    env = {"MICRODDP_TIMEOUT": LINK_TIMEOUT} if how == "link down" else {}
    with netns_helpers.Fabric(2) as net:
        first = [_start(net, 0, c10d_host0, tmp_path, **env),
                 _start(net, 1, c10d_other, tmp_path, **env)]
        out0 = Output(first[0])
        deadline = time.monotonic() + DEADLINE
        while not checkpoint.list_checkpoints(ckpts):
            assert time.monotonic() < deadline and first[0].poll() is None, out0.text()
            time.sleep(0.1)
        _lose(net, 1, how)
        lost = first[1].communicate(timeout=60)[0]
        if how == "link down":
            out0.wait_for("ranks 2,3 did not answer", first[0], timeout=180)
            net.ip(1, "link", "set", netns_helpers.IFNAME, "up")
        again = _start(net, 1, c10d_other, tmp_path, **env)
        first[0].wait(timeout=DEADLINE)
        logs = [out0.text(), _finish([again])[0]]
    assert first[1].returncode == -9, lost  # bash itself was killed
    assert [first[0].returncode, again.returncode] == [0, 0], "\n".join(logs)
    assert "resuming from ckpt-" in logs[0]
    if how == "link down":
        # where host 0's ranks were depends on when the link went (a bucket's all-reduce, the
        # checkpoint's broadcast, each rank in another one); the lost ones are named alike
        report = find_report(logs[0].splitlines())
        assert report and report[0].startswith("microddp hang report: collective "), logs[0]
        assert ("  ranks 2,3 did not answer (exited, crashed, or frozen outside Python)"
                in report), report
    got = _params(tmp_path / "runs" / "elastic" / "model.pt")
    uninterrupted = _params(two_hosts[0] / "runs" / "two-hosts" / "model.pt")
    assert got.keys() == uninterrupted.keys()
    assert all(torch.equal(got[k], uninterrupted[k]) for k in got)


def test_a_host_lost_without_a_word_ends_the_others_in_the_hang_report(tmp_path):
    """The README's static command (no restarts); after the first checkpoint host 1's link
    goes down and its processes die, so no connection of theirs is closed: host 0's ranks
    wait in DDP's hierarchical all-reduce until the process group's timeout, then end with
    the hang report naming host 1's ranks as the ones that did not answer, and torchrun on
    host 0 exits non-zero (before the fix: torch's 30 minutes, then gloo's bare timeout)."""
    static = readme_commands()[0]
    ckpts = tmp_path / "runs" / "two-hosts" / "checkpoints"
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, static, tmp_path, MICRODDP_TIMEOUT=LINK_TIMEOUT)
                 for h in range(2)]
        out0 = Output(procs[0])
        deadline = time.monotonic() + DEADLINE
        while not checkpoint.list_checkpoints(ckpts):
            assert time.monotonic() < deadline and procs[0].poll() is None, out0.text()
            time.sleep(0.1)
        _lose(net, 1, "link down")
        procs[1].communicate(timeout=60)
        # far below the 30 minutes a sub-group waited before: the world's timeout, a report
        procs[0].wait(timeout=180)
        log = out0.text()
    assert procs[0].returncode == 1, log  # torchrun: a worker failed
    report = find_report(log.splitlines())
    assert report, log
    # The first line names the collective host 0's ranks were in (a DDP bucket's
    # hierarchical_all_reduce, or the epoch report's all_reduce: the moment the link goes
    # decides; a failed call that already left the calls in flight is still named), timed out
    # in gloo's words (the group's 30 s, not the monitor's threshold); or, when host 0's
    # other rank ended first with its own report, failed on the connection it closed.
    # (The barrier at the end of the checkpoint's save, save_from_rank0, when the link goes
    # while the ranks still wait there for the file just written.)
    assert report[0].startswith(("microddp hang report: collective hierarchical_all_reduce #",
                                 "microddp hang report: collective all_reduce #",
                                 "microddp hang report: collective barrier #")), log
    assert re.search(r" on rank [01] (timed out \(Timed out waiting 30000ms|failed \(Connection "
                     r"closed by peer)", report[0]), report
    # Host 0's ranks are named where they are: in one call together ("ranks 0,1 are in"),
    # or each in its own (seen in CI: rank 1 still in the epoch report's all_reduce #51 that
    # rank 0 had left for a bucket's hierarchical_all_reduce #52); host 1's are named lost.
    lost = report.index("  ranks 2,3 did not answer (exited, crashed, or frozen outside Python)")
    where = report[1:lost]
    heads = [("  ranks 0,1 are in ",), ("  rank 0 is in ", "  rank 1 is in ")]
    assert any(len(where) == len(h) and all(w.startswith(x) for w, x in zip(where, h,
                                                                          strict=True))
               for h in heads), report


STUCK = """import sys, time
import torch
import microddp as mdp
world = mdp.init()
mdp.comms.all_reduce(torch.ones(1))
if world.rank == 3:
    time.sleep(120)  # stuck: never reaches the second all-reduce
mdp.comms.all_reduce(torch.ones(1))
"""


def test_a_rank_stuck_on_one_host_is_named_by_the_others(tmp_path):
    """The hang report across hosts on its own: rank 3 (host 1) stops calling collectives;
    the ranks of host 0 end with the report naming it and the line it is on (the monitor
    asks through the rendezvous store, which spans the hosts)."""
    (tmp_path / "stuck.py").write_text(STUCK)
    command = ("torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr "
               "$HOST0 --master-port 29400 stuck.py")
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, command, tmp_path, MICRODDP_TIMEOUT="20") for h in range(2)]
        logs = _finish(procs, timeout=240)
    assert all(p.returncode != 0 for p in procs), logs
    report = find_report(logs[0].splitlines())
    assert report and report[0].startswith(
        "microddp hang report: collective all_reduce #2 on rank "), logs[0]
    assert "  ranks 0,1,2 are in all_reduce #2 (float32[1] sum) called from <module> at " \
           "stuck.py:8" in report, report
    assert ("  rank 3 is in <module> at stuck.py:7 (not in a collective; last collective "
            "all_reduce #1)") in report, report


SINK = ("import socket; s = socket.create_server(('{addr}', 5201)); c = s.accept()[0]\n"
        "n = 0\nwhile (b := c.recv(1 << 16)): n += len(b)\nprint(n)")
SEND = ("import socket, time\nfor _ in range(200):\n    try: c = socket.create_connection("
        "('{addr}', 5201)); break\n    except OSError: time.sleep(0.1)\n"
        "c.sendall(bytes(4 << 20)); c.close()")


def _qdisc_stats(net, host: int) -> str:
    done = subprocess.run(net.command(host, [netns_helpers.TC, "-s", "qdisc", "show", "dev",
                                             netns_helpers.IFNAME]),
                          capture_output=True, text=True, timeout=30)
    return done.stdout


def test_a_shaped_link_holds_traffic_to_its_rate():
    """`rate` puts a token bucket (tbf) on each host's link: 4 MiB sent at 20 Mbit/s arrive
    whole, and the bucket's counters show it held packets back (overlimits), a count rather
    than a timing."""
    with netns_helpers.Fabric(2, rate="20mbit") as net:
        sink = net.popen(1, [sys.executable, "-c", SINK.format(addr=net.addrs[1])],
                         stdout=subprocess.PIPE, text=True)
        send = net.popen(0, [sys.executable, "-c", SEND.format(addr=net.addrs[1])])
        assert send.wait(timeout=120) == 0
        assert int(sink.communicate(timeout=60)[0]) == 4 << 20
        stats = _qdisc_stats(net, 0)
    assert "qdisc tbf" in stats and "rate 20Mbit" in stats, stats
    sent = int(re.search(r"Sent (\d+) bytes", stats).group(1))
    overlimits = int(re.search(r"overlimits (\d+)", stats).group(1))
    assert sent >= 4 << 20 and overlimits > 0, stats


def test_a_delay_needs_netem_in_the_kernel():
    """`delay` needs tc netem; where the kernel lacks it, Fabric says so in one sentence."""
    try:
        net = netns_helpers.Fabric(2, delay="50us")
    except RuntimeError as e:
        assert str(e) == netns_helpers.NO_NETEM
        pytest.skip(netns_helpers.NO_NETEM)
    with net:
        stats = _qdisc_stats(net, 0)
    assert "qdisc netem" in stats and "delay 50us" in stats, stats


HELLO = ("torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $HOST0 "
         "--master-port 29400 -m microddp.commands.hello")


def _two_hosts_hello(net, tmp_path, **host1_env) -> list[str]:
    procs = [_start(net, 0, HELLO, tmp_path, MICRODDP_TIMEOUT="30"),
             _start(net, 1, HELLO, tmp_path, MICRODDP_TIMEOUT="30", **host1_env)]
    logs = _finish(procs, timeout=180)
    assert all(p.returncode != 0 for p in procs), logs
    return logs


def test_a_rank_that_advertises_loopback_to_another_host_is_named(tmp_path):
    with netns_helpers.Fabric(2) as net:
        logs = _two_hosts_hello(net, tmp_path, GLOO_SOCKET_IFNAME="lo")
    line = (f"rank 2 on host {HOST} advertises the loopback address 127.0.0.1 to ranks on other "
            "hosts, which cannot reach it; set GLOO_SOCKET_IFNAME on that host")
    assert all(line in log for log in logs), logs


def test_microddp_run_nnodes_is_torchrun_on_every_host(tmp_path):
    command = ("microddp run -n 2 --nnodes 2 --node-rank $NODE_RANK --master-addr $HOST0 "
               "-m microddp.commands.hello")
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, command, tmp_path) for h in range(2)]
        logs = _finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "all_reduce(sum of ranks) = 6 (expected 6)" in logs[0]
    assert "hello from rank 3 of 4 (local rank 1" in logs[1]


RUN = ("microddp run -n 2 --nnodes {n} --node-rank $NODE_RANK --master-addr {addr} "
       "--join-timeout {t} -m microddp.commands.hello")


def test_a_host_that_never_joins_is_named_by_the_others_at_the_deadline(tmp_path):
    """3 hosts in the job, host 2 never started: hosts 0 and 1 stop at --join-timeout with
    the same one line, before torchrun (whose own rendezvous would only say it timed out)."""
    command = RUN.format(n=3, addr="$HOST0", t=20)
    with netns_helpers.Fabric(3) as net:
        procs = [_start(net, h, command, tmp_path) for h in range(2)]
        logs = _finish(procs, timeout=240)
    line = ("microddp run: error: node rank(s) 2 of 3 never joined the rendezvous at "
            "$HOST0:29400 within 20 s; start `microddp run` on that host with its --node-rank "
            "and the same --nnodes, --master-addr and --master-port, and check that it can "
            "reach 10.213.0.1:29400 (`ip route get 10.213.0.1`, firewall)")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 2, log
        *before, last = log.strip().splitlines()
        assert last == line.replace("$HOST0", "10.213.0.1"), log
        # beside it, at most torch's C++ warning that the namespace has no reverse DNS, and
        # that the job runs without a secret (docs/security.md)
        assert all((x.startswith("[W") and "socket.cpp" in x)
                   or x.startswith("microddp run: warning: no job secret") for x in before), log


RAW = {  # chapter 11's raw torchrun commands for 3 hosts, with the rendezvous bounded
    "static": ("torchrun --nnodes 3 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr "
               "$HOST0 --master-port 29400 --rdzv-conf timeout=20 -m microddp.commands.hello"),
    "c10d": ("torchrun --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
             "$HOST0:29400 --rdzv-conf {host}join_timeout=20 --local-addr {addr} "
             "-m microddp.commands.hello"),
}


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_raw_torchrun_with_a_host_missing_stops_at_the_rendezvous_timeout_it_was_given(
        tmp_path, rendezvous):
    """What chapter 11 tells raw torchrun users: a host that never joins leaves the others
    waiting inside torchrun's rendezvous (600 s by default) until `--rdzv-conf timeout=N`
    (static) or `join_timeout=N` (c10d) says otherwise; then torchrun stops every host that
    came, with its own words (microddp's code has not run yet)."""
    if rendezvous == "static":
        commands = [RAW["static"]] * 2
    else:
        commands = [RAW["c10d"].format(host="is_host=1,", addr="$HOST0"),
                    RAW["c10d"].format(host="", addr="$THIS_HOST")]
    with netns_helpers.Fabric(3) as net:
        procs = [_start(net, h, commands[h], tmp_path) for h in range(2)]
        logs = _finish(procs, timeout=180)  # far below torchrun's default 600 s
    assert [p.returncode for p in procs] == [1, 1], logs
    if rendezvous == "static":
        assert "waiting for clients. 2/3 clients joined." in logs[0], logs[0]
    else:
        # The agent whose join_timeout runs out first raises RendezvousTimeoutError and closes
        # the rendezvous; the other one, still waiting, then ends on RendezvousClosedError,
        # or, when host 0 (which serves the store) was first and has gone, on the store's
        # RendezvousConnectionError. Which one is first is a race (both seen here and in CI).
        ends = ("RendezvousTimeoutError", "RendezvousClosedError", "RendezvousConnectionError")
        assert any("RendezvousTimeoutError" in log for log in logs), logs
        assert all(any(end in log for end in ends) for log in logs), logs
    assert "hello from rank" not in "".join(logs)


def test_an_address_nobody_has_fails_fast_with_one_line(tmp_path):
    """--master-addr inside the hosts' subnet but held by no one: host 1 stops as soon as the
    kernel finds no machine there (ARP), not at the 600 s join timeout; host 0, told to serve
    the rendezvous at an address that is not its own, stops at once."""
    nobody = f"{netns_helpers.SUBNET}.99"
    command = RUN.format(n=2, addr=nobody, t=600)
    with netns_helpers.Fabric(2) as net:
        procs = [_start(net, h, command, tmp_path) for h in range(2)]
        logs = _finish(procs, timeout=180)  # well under --join-timeout: a fast failure
    assert [p.returncode for p in procs] == [2, 2], logs
    assert logs[0].strip() == (
        f"microddp run: error: --master-addr {nobody} is not an address of this host, but "
        "--node-rank 0 serves the rendezvous there (port 29400); give host 0's own address "
        "(`hostname -I` lists them), or run this host with its own --node-rank")
    assert logs[1].strip() == (
        f"microddp run: error: cannot reach --master-addr {nobody} (No route to host): no "
        "machine answers at that address from this host; check the address of host 0 "
        f"(`hostname -I` there) and that this host has a route to it (`ip route get {nobody}`)")
