"""Chapter 2.3: the classic deadlock, caught by a timeout, and its two standard fixes.

    python course/02_point_to_point/deadlock.py

Two ranks each call a blocking send() to the other, then recv(). A send cannot finish until
the other side posts its receive, and neither rank gets that far: both wait forever. gloo
waits for the receive whatever the size; MPI and NCCL buffer small messages, so there the bug
hides until the tensors grow. A group with a short timeout turns the hang into an error.
Fixes: order the calls (even ranks send first, odd ranks receive first), or start the send
without waiting for it (isend), receive, then wait.
"""

import time

import torch

import microddp as mdp
from microddp import MicroDDPError, comms

MIB = 1 << 20
SIZE = 16 * MIB // 4  # float32 elements: 16 MiB
TIMEOUT_S = 3


def both_send_first(world) -> str:
    group = comms.new_group([0, 1], timeout=TIMEOUT_S)
    other = 1 - world.rank
    mine, theirs = torch.full((SIZE,), float(world.rank)), torch.empty(SIZE)
    start = time.perf_counter()
    try:
        comms.send(mine, dst=other, group=group)  # both ranks block right here
        comms.recv(theirs, src=other, group=group)
    except (RuntimeError, MicroDDPError) as e:
        waited = time.perf_counter() - start
        how = "its send timed out" if "Timed out" in str(e) else "its peer gave up first"
        return f"rank {world.rank}: stuck in send, {how} after {waited:.0f} s"
    return f"rank {world.rank}: no deadlock?"


def even_odd(world) -> float:
    other = 1 - world.rank
    mine, theirs = torch.full((SIZE,), float(world.rank)), torch.empty(SIZE)
    if world.rank % 2 == 0:  # one side sends while the other receives, then they swap
        comms.send(mine, dst=other)
        comms.recv(theirs, src=other)
    else:
        comms.recv(theirs, src=other)
        comms.send(mine, dst=other)
    return theirs[0].item()


def isend_then_recv(world) -> float:
    other = 1 - world.rank
    mine, theirs = torch.full((SIZE,), float(world.rank)), torch.empty(SIZE)
    handle = comms.isend(mine, dst=other)  # returns at once: nobody waits on the send yet
    comms.recv(theirs, src=other)
    handle.wait()  # only now may `mine` be reused
    return theirs[0].item()


def main() -> None:
    print(f"deadlock: both ranks send 16 MiB first (group timeout {TIMEOUT_S} s)")
    for line in mdp.spawn(both_send_first, 2, timeout=60, backend="gloo"):
        print("  " + line)
    print("  -> deadlock detected: each send waits for a receive that is never posted")
    for name, fix in (("even/odd ordering", even_odd), ("isend + recv", isend_then_recv)):
        start = time.perf_counter()
        got = mdp.spawn(fix, 2, timeout=60, backend="gloo")
        print(f"fix, {name}: rank 0 received {got[0]:.0f}, rank 1 received {got[1]:.0f} "
              f"({time.perf_counter() - start:.1f} s including start-up)")


if __name__ == "__main__":
    main()
