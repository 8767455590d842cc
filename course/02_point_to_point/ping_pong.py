"""Chapter 2.1: ping-pong. Two ranks bounce a tensor; each adds one before sending it back.

    python course/02_point_to_point/ping_pong.py

send() returns once the tensor may be reused; recv() returns once the data has arrived. The
pair is the smallest distributed program there is, and timing it measures the latency of one
message on this machine.
"""

import time

import torch

import microddp as mdp
from microddp import comms

ROUNDS = 3
TIMED_ROUNDS = 200


def ping_pong(world) -> dict:
    ball = torch.zeros(4)
    other = 1 - world.rank
    log = []
    for i in range(ROUNDS):
        if world.rank == 0:
            comms.send(ball, dst=other)
            comms.recv(ball, src=other)
            log.append(f"round {i + 1}: rank 0 got back {ball.tolist()}")
        else:
            comms.recv(ball, src=other)
            ball += 1  # rank 1's whole job: change the data, so we can see it travelled
            comms.send(ball, dst=other)
    # Time many round trips: one is too short to measure and too noisy to trust.
    start = time.perf_counter()
    for _ in range(TIMED_ROUNDS):
        if world.rank == 0:
            comms.send(ball, dst=other)
            comms.recv(ball, src=other)
        else:
            comms.recv(ball, src=other)
            ball += 1
            comms.send(ball, dst=other)
    one_way_us = (time.perf_counter() - start) / TIMED_ROUNDS / 2 * 1e6
    return {"log": log, "one_way_us": one_way_us, "final": ball.tolist()}


def main() -> None:
    out = mdp.spawn(ping_pong, 2, backend="gloo")[0]
    for line in out["log"]:
        print(line)
    print(f"after {ROUNDS + TIMED_ROUNDS} round trips rank 0 holds {out['final']}")
    print(f"one-way latency of a 16-byte message: about {out['one_way_us']:.0f} us")


if __name__ == "__main__":
    main()
