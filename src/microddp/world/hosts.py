"""Which network interface a rank talks on when the job spans hosts, and what a host is.

gloo, left alone, advertises the address its hostname resolves to; in many containers and
clusters that is 127.0.0.1, which a rank on another host cannot reach (gloo's connectFullMesh
then fails or hangs). The interface that routes to MASTER_ADDR is the one every other host
can reach too, so microddp picks it, with no external tool: a UDP socket "connected" to
MASTER_ADDR (no packet leaves) tells the kernel's choice of source address, and the interface
holding that address is the one to name in GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from ..errors import MicroDDPError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def is_loopback(addr: str) -> bool:
    """Whether `addr` (a name or an address) means this host only."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def route_source(addr: str) -> str:
    """The local address the kernel would send from to reach `addr` (no packet is sent)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
    except OSError as e:
        raise MicroDDPError(f"cannot resolve MASTER_ADDR {addr!r} ({e}); give an address or a "
                            "host name that every host resolves") from None
    with socket.socket(family, kind, proto) as s:
        try:
            s.connect(sockaddr)
        except OSError as e:
            raise MicroDDPError(f"no route from this host to MASTER_ADDR {addr} ({e.strerror}); "
                                "check the address, or set GLOO_SOCKET_IFNAME") from None
        return s.getsockname()[0]


def ipv4_of(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address -> interface name, from /proc/net/if_inet6 (Linux)."""
    found = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    raw = fields[0]
                    addr = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
                    found[str(ipaddress.ip_address(addr))] = fields[5]
    except OSError:
        pass
    return found


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds local address `addr`, or None."""
    ip = ipaddress.ip_address(addr)
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == addr:
            return name
    return None


def advertised(var: str = "GLOO_SOCKET_IFNAME") -> str:
    """The address gloo will give the other ranks: that of the interface named in `var`, or
    else what this host's name resolves to (gloo's own default)."""
    names = os.environ.get(var, "")
    if names:
        first = names.split(",")[0].strip()
        addr = ipv4_of(first)
        if addr is None:
            raise MicroDDPError(f"{var}={names!r}, but this host has no interface {first!r} with "
                                "an IPv4 address; name one that `ip -brief address` lists")
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def choose_interface(master_addr: str) -> tuple[str, str] | None:
    """Name the interface that routes to `master_addr` in GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME, unless the user named one; return (interface, address) when this call
    chose it, None when nothing was chosen (the user's choice stands, or the only route is the
    loopback, which the preflight then reports)."""
    if any(os.environ.get(v) for v in IFNAME_VARS):
        return None
    source = route_source(master_addr)
    name = interface_of(source)
    if name is None or ipaddress.ip_address(source).is_loopback:
        return None
    for var in IFNAME_VARS:
        os.environ[var] = name
    return name, source


def host_id() -> str:
    """What ranks that can reach each other over the loopback share: the machine (its boot id,
    since two machines may carry one hostname) and the network namespace (each container, or
    `ip netns`, has its own loopback). Ranks with equal ids are on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"
