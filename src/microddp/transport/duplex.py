"""Two ranks on gloo: a second connection, so that each direction has a socket of its own.

In a ring of 3 or more ranks a rank sends to one neighbour and receives from another: two
connections. With 2 ranks both neighbours are one rank, and gloo gives a pair of ranks one
connection (one socket, one lock) for both directions. A send to a receiver that has posted
its buffer is written by the calling thread, holding that lock, while gloo's I/O thread,
which reads incoming messages, cannot take it: the two directions take turns.

So the ring on a 2-rank gloo group opens a second process group over the same ranks (its own
sockets and I/O thread) and sends every message from group rank 1 to 0 over it, those from 0
to 1 over the group itself (`Peers.isend`/`irecv` route them); chapter 4 has the timings.
Opening it is collective (through the group's own store), so only code both ranks run at the
same point may call `duplex`: the ring, on its first call on a group. It lives as long as the
group's Python object (kept weakly). MICRODDP_DUPLEX=0 (agreed on by the ring's check:
`duplex_setting`) keeps one connection. Only gloo groups get one: NCCL pairs its own
channels, and MPI or UCC groups may hold GPU tensors a gloo connection cannot send.
"""

from __future__ import annotations

import os
import weakref

import torch.distributed as dist

from ..errors import MicroDDPError
from ..world.world import group_timeout
from .peers import Peers

_backs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> second group or None
_UNSEEN = object()


def duplex_enabled() -> bool:
    """Whether the ring opens a second connection on 2-rank gloo groups (MICRODDP_DUPLEX)."""
    return os.environ.get("MICRODDP_DUPLEX", "1").strip() not in ("0", "false", "no", "off")


def duplex_setting(peers: Peers) -> int:
    """The MICRODDP_DUPLEX a ring call's check holds. Before the group's connections are
    settled, the variable: the first ring call opens the second connection (or not), and ranks
    that disagree would wait for each other on different connections. After, whether the group
    has a second connection, the same on every rank: a later change of the variable changes
    nothing, so a kept call (ring/plan.py's memo, which does not read the environment) and a
    new one send the same value."""
    back = _backs.get(peers.pg, _UNSEEN) if peers.pg is not None else _UNSEEN
    return int(duplex_enabled()) if back is _UNSEEN else int(back is not None)


def duplex_decided(peers: Peers) -> bool:
    """Whether this group's connections are settled (by its first ring call), so that `duplex`
    only looks them up: no exchange, nothing to agree on first."""
    return peers.pg in _backs


def duplex(peers: Peers) -> Peers:
    """`peers`, with messages from group rank 1 to 0 on a connection of their own, if this is
    a 2-rank gloo group and the feature is on; opened on first use, which is collective."""
    if peers.size != 2 or peers.nccl or peers.back is not None:
        return peers
    back = _backs.get(peers.pg, _UNSEEN)
    if back is _UNSEEN:  # decided once per group, so every later call on it agrees
        wanted = duplex_enabled() and dist.get_backend(peers.pg) == "gloo"  # not MPI, UCC
        back = _backs[peers.pg] = _open(peers) if wanted else None
    peers.back = back
    return peers


def _open(peers: Peers):
    """A gloo process group over the same two ranks, meeting through the group's store."""
    store = dist.PrefixStore("microddp-duplex/", peers.pg.get_group_store())
    try:
        return dist.ProcessGroupGloo(store, peers.me, 2, group_timeout(peers.pg))
    except Exception as e:  # e.g. the other rank never came: it failed before its first ring
        raise MicroDDPError(
            f"ring_all_reduce: could not open the second connection between the 2 ranks of "
            f"this group ({type(e).__name__}: {e}); it opens on the first ring_all_reduce "
            "on the group, which every rank of it must reach. MICRODDP_DUPLEX=0 on every rank "
            "keeps one connection") from e


def open_duplexes() -> int:
    """How many second connections are open in this process (for tests)."""
    return sum(back is not None for back in _backs.values())
