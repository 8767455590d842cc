"""Chapter 2.2: non-blocking isend / irecv. Every rank passes its tensor to its right-hand
neighbour and receives from its left, all at once, and works while the data travels.

    python course/02_point_to_point/nonblocking.py

isend/irecv return a handle at once; the data is only safe to read (irecv) or to overwrite
(isend) after handle.wait(). Posting the receive first lets the data land straight in place.
"""

import torch

import microddp as mdp
from microddp import comms

WORLD_SIZE = 4


def shift_right(world) -> str:
    me, n = world.rank, world.world_size
    mine = torch.full((3,), float(me * 10))
    incoming = torch.empty(3)
    recv = comms.irecv(incoming, src=(me - 1) % n)
    send = comms.isend(mine, dst=(me + 1) % n)
    busy = sum(i * i for i in range(10_000))  # useful work overlapping the transfer
    recv.wait()
    send.wait()
    return (f"rank {me}: sent {mine.tolist()} to rank {(me + 1) % n}, received "
            f"{incoming.tolist()} from rank {(me - 1) % n} (did work={busy > 0} meanwhile)")


def main() -> None:
    for line in mdp.spawn(shift_right, WORLD_SIZE, backend="gloo"):
        print(line)


if __name__ == "__main__":
    main()
