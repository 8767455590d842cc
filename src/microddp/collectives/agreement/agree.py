"""Recursive doubling, and the cheap metadata check built on it.

Recursive doubling (a butterfly) lets every rank end with op over all ranks in ceil(log2 p)
exchange rounds. It serves twice: as `tree_all_reduce` for small tensors, and to make every
rank agree on shapes, dtypes and ops *before* any data moves, so that a mismatch becomes the
same clear error on every rank instead of a hang or a silently wrong result.
"""

from __future__ import annotations

import array
from collections.abc import Callable

import torch

from ...errors import MicroDDPError
from ...shm import collectives as shm
from ...shm.agreement import SharedAgreement
from ...shm.checked import read_in_memory
from ...shm.verdict import SLOTS, described, encode, judge
from ...transport.peers import Peers, wait_all
from ...world.args import check_kind
from .checks import try_layout, try_list, try_op, try_root, try_tensor

# The tag of a butterfly's first exchange: on 2 ranks, the only one. A header carried beside the
# ring's data (carried.py) goes with it, so that it meets another rank's agreement.
FIRST_TAG = 3


def butterfly_(peers: Peers, buf: torch.Tensor, scratch: torch.Tensor,
               combine: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """In place: every rank's `buf` becomes combine over all ranks' `buf`, bit-identical.

    For p not a power of two, the first 2*rem ranks pair up (even folds into odd) so that a
    power of two take part; the folded ranks get the result back at the end.
    """
    p, r = peers.size, peers.me
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if r < 2 * rem and r % 2 == 0:
        peers.send(buf, r + 1, 1)
        peers.recv(buf, r + 1, 2)
        return
    if r < 2 * rem:
        peers.recv(scratch, r - 1, 1)
        _ordered(combine, buf, scratch, mine_first=False)  # the even rank's operand first
    vr = r // 2 if r < 2 * rem else r - rem
    mask, tag = 1, FIRST_TAG
    while mask < pof2:
        vpeer = vr ^ mask
        peer = 2 * vpeer + 1 if vpeer < rem else vpeer + rem
        wait_all(peers.exchange(buf, peer, scratch, peer, tag))
        _ordered(combine, buf, scratch, mine_first=vr < vpeer)
        mask, tag = mask << 1, tag + 1
    if r < 2 * rem:
        peers.send(buf, r - 1, 2)


def _ordered(combine: Callable[[torch.Tensor, torch.Tensor], object], buf: torch.Tensor,
             other: torch.Tensor, mine_first: bool) -> None:
    """buf = combine(lower rank's operand, higher rank's), so both sides of an exchange get
    the same bits: min and max of 0.0 and -0.0 depend on the order of their arguments."""
    if mine_first:
        combine(buf, other)
    else:
        combine(other, buf)
        buf.copy_(other)


# On 2 ranks (not NCCL) the ring may send its header together with its first chunk of data, up
# to INLINE_MAX_CHUNK bytes of it, in one message (carried.py). Every message on the
# agreement's tag between 2 such ranks is then PAIR_WORDS long, an agreement's or a header's
# too, padded: the numbers first, then the data or zeros. A mismatched pair still exchanges
# messages of one size, whatever either rank called.
INLINE_MAX_CHUNK = 4096
PAIR_WORDS = 2 * SLOTS + INLINE_MAX_CHUNK // 8


_PAD = array.array("q", bytes(8 * (PAIR_WORDS - 2 * SLOTS)))


def message_words(peers: Peers) -> int:
    """How many int64 an agreement (or a ring's header, carried.py) sends in `peers`."""
    return PAIR_WORDS if peers.size == 2 and not peers.nccl else 2 * SLOTS


def describe_tensor(tensor) -> dict:
    """What every rank must pass alike: shape, dtype and kind of device (placeholders for a
    non-tensor, whose rank reports its problem instead)."""
    if not isinstance(tensor, torch.Tensor):
        return {"shape": None, "dtype": None, "device": None}
    return {"shape": tuple(tensor.shape), "dtype": tensor.dtype, "device": tensor.device.type}


def home(tensor, peers: Peers) -> torch.device:
    """Where the agreement's numbers live: the tensor's device, or the group's if it is none."""
    if isinstance(tensor, torch.Tensor):
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if peers.nccl else torch.device("cpu")


def agree(peers: Peers, where: str, place: torch.device, problem: Exception | None = None,
          check: bool = True, settings: dict | None = None, **fields) -> None:
    """Raise the same MicroDDPError on every rank unless all ranks passed equal `fields` (the
    caller's arguments) and `settings` (what the environment chose, e.g. MICRODDP_DUPLEX).

    `problem` is this rank's own complaint about its arguments (found by local checks): it is
    shared too, so that the other ranks raise instead of waiting for a rank that gave up. One
    butterfly over max(v) and max(-v) gives every rank both the maximum and the minimum of
    each field; a field is consistent exactly when they are equal. With `check=False` nothing
    is exchanged and only this rank's own problem is raised. Where the group's ranks share
    memory, the numbers go through it instead of the butterfly (shm/agreement.py), to the same
    result.
    """
    if not check or peers.size <= 1:
        if problem is not None:
            raise problem
        return
    settings = settings or {}
    fields = described(where, problem, fields, settings)
    box = shared_agreement(peers)
    if box is not None:
        _agree_in_memory(peers, box, array.array("q", encode(fields)), where, fields,
                         settings, problem)
        return
    # Everything before the first send delays the other ranks too, so this is built and read
    # back the cheap way: from a Python array, and with one tolist (torch.tensor() from a
    # list, slicing and negating tensors cost 25 us more per call, measured).
    words = array.array("q", encode(fields))
    if message_words(peers) > len(words):
        words += _PAD  # before torch.frombuffer: an array with a view of it cannot grow
    buf = torch.frombuffer(words, dtype=torch.int64)
    if place.type != "cpu":  # where the group's backend can send it
        buf = buf.to(place)
    butterfly_(peers, buf, torch.empty_like(buf), lambda a, b: torch.maximum(a, b, out=a))
    # Only the numbers are read: past them is padding, or another rank's data (a header's).
    combined = words[:2 * SLOTS].tolist() if place.type == "cpu" else buf[:2 * SLOTS].tolist()
    judge(where, peers.me, fields, settings, combined, problem)


def shared_agreement(peers: Peers) -> SharedAgreement | None:
    """Where this group agrees through shared memory (every rank on this host, gloo, not
    MICRODDP_TRANSPORT=gloo: decided once per group, alike on every rank); None: through the
    butterfly. The group's first call sets its shared memory up (collective over the group)."""
    if peers.nccl:
        return None
    state = shm.shared(peers.group)
    if state is None:
        return None
    state.lane.drain()  # its queued calls agree here too, before this one
    return state.group.agreement


def _agree_in_memory(peers: Peers, box: SharedAgreement, mine: array.array, where: str,
                     fields: dict, settings: dict, problem: Exception | None) -> None:
    """agree() through shared memory: `mine` is encode(fields)."""
    read_in_memory(peers, box, box.post(mine), mine, where, fields, settings, problem)


def agreed(where: str, fields: dict, settings: dict,
           loop: Callable[[Peers], object]) -> Callable[[Peers], None]:
    """`loop`, preceded by the agreement on `fields` and `settings` through shared memory: a
    repeat call's whole work (ring/plan.py's memo), for a group where shared_agreement is
    not None. Holds neither a tensor nor the group."""
    fields = described(where, None, fields, settings)
    mine = array.array("q", encode(fields))

    def run(peers: Peers) -> None:
        _agree_in_memory(peers, shared_agreement(peers), mine, where, fields, settings, None)
        loop(peers)

    return run


def begin_all_reduce(tensor: torch.Tensor, op: str, group, check: bool,
                     where: str, problem: MicroDDPError | None = None,
                     **settings) -> tuple[Peers, str] | None:
    """What every all-reduce does before moving data: validate the tensor and op, and agree
    across ranks on shape, dtype, op and any `settings` the algorithm needs the same on every
    rank. `problem`: the caller's own complaint about its other arguments, shared like the
    rest. Returns (peers, op name), or None off the group."""
    local = check_all_reduce(tensor, op, group, where, problem)
    if local is None:
        return None
    peers, name, problem = local
    agree(peers, where, home(tensor, peers), problem, check, settings, **describe_tensor(tensor),
          op=name)
    return (peers, name) if peers.size > 1 else None


def check_all_reduce(tensor: torch.Tensor, op: str, group, where: str,
                     problem: MicroDDPError | None = None
                     ) -> tuple[Peers, str, MicroDDPError | None] | None:
    """The local half of begin_all_reduce: (peers, op name, this rank's problem or None), or
    None off the group; the problem is still to be shared (agree, or a header: carried.py)."""
    peers = Peers(group)
    if not peers.member:
        check_kind(tensor, where)
        return None
    problem = problem or try_tensor(tensor, where)
    name = str(op)
    if problem is None:
        name, problem = try_op(op, tensor, where)
        problem = problem or try_layout(tensor, where)
    return peers, name, problem


def begin_rooted(tensor: torch.Tensor, where: str, group, check: bool, root_name: str,
                 root_rank: int | None, op=None, parts=None, parts_name: str | None = None,
                 result_in: str = "tensor", group_root: int | None = None):
    """What every rooted collective (broadcast, reduce, scatter, gather) does before moving
    data: validate the tensor, the root (`root_name` is the argument's name, src or dst), the
    op if it takes one and, on the root, its list of per-rank tensors if it takes one (the
    root is global rank `root_rank` or, torch's group_src/group_dst, `group_root`); then
    agree across ranks on shape, dtype, op and root. `result_in` says where results are
    written, which must be able to hold them: "tensor" (every rank's), "root" (the root's
    tensor only: reduce) or "list" (the root's list: gather, which only reads `tensor`).
    Returns (peers, group rank of the root, op name or None, the root's list or []), or None
    off the group.
    """
    peers = Peers(group)
    if not peers.member:
        check_kind(tensor, where)
        return None
    problem = try_tensor(tensor, where)
    name = None
    root, root_problem = try_root(peers, root_rank, root_name, group_root)
    if problem is None:
        name, problem = try_op(op, tensor, where) if op is not None else (None, None)
        written = result_in == "tensor" or (result_in == "root" and peers.me == root)
        problem = problem or root_problem or try_layout(tensor, where, written=written)
    items: list = []
    if parts_name is not None and problem is None and peers.me == root:
        items, problem = try_list(parts, tensor, peers.size, where, parts_name,
                                  written=result_in == "list")
    fields = describe_tensor(tensor)
    if op is not None:
        fields["op"] = name if name is not None else str(op)
    if group_root is None:  # agreed on as a global rank, however it was given
        agreed = 0 if root_rank is None else root_rank
    else:
        agreed = peers.global_rank(root) if check and root_problem is None else group_root
    agree(peers, where, home(tensor, peers), problem, check, **fields, **{root_name: agreed})
    return peers, root, name, items


