"""Several "hosts" on one machine for the many-hosts tests (not a test module itself): Linux
network namespaces, each with its own loopback and one interface `mddp0` on a shared bridge.

Each namespace has its own network stack, so a rank inside one reaches another "host" only
through the bridge at that host's 10.213.0.x address, exactly as across real machines, while
the hostname still resolves to 127.0.0.1 (as in many containers). Every name is unique to one
`Fabric`; everything it made is removed on close(), at exit, and the processes it started are
killed first. Traffic goes only to the addresses it created.

    with Fabric(2, rate="10gbit", delay="50us") as net:
        p = net.popen(0, ["python", "-c", "..."])

As a script it runs one shell command on every "host" (with HOST0, NODE_RANK and THIS_HOST
set, as the README's commands expect) and prints host 0's output; the many-hosts page's
figures come from it:

    sudo .venv/bin/python tests/netns_helpers.py --hosts 2 --rate 10gbit -- \
        'torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $HOST0 \
                  --master-port 29400 -m microddp.bench.hierarchical'
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import uuid

SUBNET = "10.213.0"
NO_NETEM = ("this kernel has no tc netem qdisc (CONFIG_NET_SCH_NETEM), so a link cannot be "
            "given a delay here; --rate alone shapes it with tbf")
IFNAME = "mddp0"


def _tool(name: str) -> str:
    """Where an iproute2 tool is: on PATH, or in the sbin folders a root shell has on PATH and
    a bare environment (`env -i`, some CI runners) does not (Debian puts `tc` only there)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


TC = _tool("tc")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a pytest skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"mddp-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


class Fabric:
    """`hosts` namespaces joined by a bridge; host i has address 10.213.0.(i+1) on `mddp0`.
    `rate` shapes each host's outgoing link (e.g. "10gbit": tc tbf), `delay` delays it (e.g.
    "50us": tc netem, which needs a kernel with CONFIG_NET_SCH_NETEM)."""

    def __init__(self, hosts: int, rate: str | None = None, delay: str | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.switch = f"mddp-{tag}-sw"
        self.names = [f"mddp-{tag}-h{i}" for i in range(hosts)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        atexit.register(self.close)
        try:
            self._build(rate, delay)
        except BaseException:
            self.close()
            raise

    def _build(self, rate: str | None, delay: str | None) -> None:
        for ns in [self.switch, *self.names]:
            _ip("ip", "netns", "add", ns)
            self._made.append(ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("ip", "link", "set", "br0", "up", ns=self.switch)
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            port = f"p{i}"
            _ip("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("ip", "link", "set", port, "master", "br0", "up", ns=self.switch)
            _ip("ip", "addr", "add", f"{addr}/24", "dev", IFNAME, ns=ns)
            _ip("ip", "link", "set", IFNAME, "up", ns=ns)
            if delay:  # netem adds the delay (and the rate with it)
                netem = ["delay", delay] + (["rate", rate] if rate else [])
                try:
                    _ip(TC, "qdisc", "add", "dev", IFNAME, "root", "netem", "limit", "100000",
                        *netem, ns=ns)
                except RuntimeError as e:
                    if "unknown" not in str(e):
                        raise
                    raise RuntimeError(NO_NETEM) from None
            elif rate:  # a token bucket: in every kernel, where netem often is not
                _ip(TC, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", rate,
                    "burst", "512kb", "latency", "50ms", ns=ns)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ip(self, host: int, *args: str) -> None:
        """Run `ip ARGS` inside host `host` (e.g. add an interface no other host can reach)."""
        _ip("ip", *args, ns=self.names[host])

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` on host `host` in a session of its own (killed, with its children, by
        kill() and close())."""
        p = subprocess.Popen(self.command(host, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill(self, p: subprocess.Popen) -> None:
        """SIGKILL `p` and every process of its session."""
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process inside host `host`'s namespace, as if the machine died;
        returns their pids."""
        listed = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                                text=True, timeout=30)
        pids = [int(x) for x in listed.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        for p in self.procs:
            self.kill(p)
        self.procs = []
        for host, ns in enumerate(self.names):  # anything left inside: a worker's children
            if ns in self._made:
                self.kill_host(host)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []


def main() -> int:
    p = argparse.ArgumentParser(description="Run a shell command on every host of a Fabric.")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default=None, help='e.g. "10gbit": each host\'s outgoing link')
    p.add_argument("--delay", default=None, help='e.g. "50us" (needs tc netem in the kernel)')
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("command", help="run with bash -c; $HOST0 $NODE_RANK $THIS_HOST are set")
    args = p.parse_args()
    reason = unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    try:
        net = Fabric(args.hosts, args.rate, args.delay)
    except RuntimeError as e:
        print(f"cannot run: {e}", file=sys.stderr)
        return 2
    with net:
        env = {k: v for k, v in os.environ.items()
               if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
        procs = [net.popen(h, ["bash", "-c", args.command],
                           env={**env, "HOST0": net.addrs[0], "NODE_RANK": str(h),
                                "THIS_HOST": net.addrs[h]},
                           stdout=None if h == 0 else subprocess.DEVNULL)
                 for h in range(args.hosts)]
        codes = [p.wait(timeout=args.timeout) for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
