"""The launcher's part in an elastic job (`microddp train --elastic`): no rank's end stops it.

A worker that dies is reported and marked dead in the job's store (so the survivors need not
wait for its heartbeat to stall: train/elastic_group.py); the survivors go on among themselves.
The job ends when every worker has ended, or a while after the first finished the training
(a rank fenced out while frozen may never wake on its own). Its exit code is 0 if a worker
finished the training, else the last failure's (the survivors' verdict).
"""

from __future__ import annotations

import sys
import time

from .procs import AgentStore, describe_exit


def dead_key(member: int) -> str:
    """The store key that says member `member`'s process has ended (train/elastic_group.py
    reads it)."""
    return f"elastic/dead/{member}"


GRACE_S = 20.0  # after one worker finished: how long the others get to finish too


class ElasticWatch:
    """What the launcher's poll loop asks, for an elastic job."""

    def __init__(self, agent: AgentStore, n: int, replacements: int = 0) -> None:
        self.agent, self.budget = agent, replacements
        self.ids = list(range(n))  # each worker's member id, in the launcher's order
        self.slots = list(range(n))  # each worker's launcher slot (a replacement takes over one)
        self.next_id = n
        self._pending: list[tuple[int, int]] = []
        self.marked: set[int] = set()
        self.first_done: float | None = None
        self.last_failure: int | None = None
        self._store = None

    def _mark_dead(self, rank: int) -> None:
        from ..world.store_client import AuthStore  # noqa: PLC0415 (torch: only when needed)

        try:
            if self._store is None:
                self._store = AuthStore(self.agent.addr, self.agent.secure_port,
                                        self.agent.secret)
            self._store.set(dead_key(rank), "1")
        except Exception:  # noqa: BLE001 (the heartbeat watch notices it anyway)
            pass

    def poll(self, codes: list[int | None]) -> int | None:
        """The job's exit code once it is over, else None; marks newly ended failures."""
        for pos, code in enumerate(codes):
            if code not in (None, 0) and pos not in self.marked:
                self.marked.add(pos)
                self._mark_dead(self.ids[pos])
                print(f"microddp run: id {self.ids[pos]} ended ({describe_exit(code)}); "
                      "--elastic: the others go on without it", file=sys.stderr, flush=True)
                alive = any(c is None for c in codes)
                if self.budget > 0 and alive and not any(c == 0 for c in codes):
                    self.budget -= 1  # a replacement takes the lost worker's slot
                    self._pending.append((self.slots[pos], self.next_id))
                    self.ids.append(self.next_id)
                    self.slots.append(self.slots[pos])
                    self.next_id += 1
                # The last to end decides: the survivors' own verdict (below --min-ranks),
                # not the first loss, which they were built to survive.
                self.last_failure = code if code > 0 else 128 - code
        if any(c == 0 for c in codes):
            self.first_done = self.first_done or time.monotonic()
            if all(c is not None for c in codes) or \
                    time.monotonic() - self.first_done > GRACE_S:
                return 0
        elif all(c is not None for c in codes):
            return self.last_failure or 1
        return None

    def take_replacements(self) -> list[tuple[int, int]]:
        """(slot, new member id) of each replacement to start now; the slot's environment is
        the lost worker's (its LOCAL_RANK: its device)."""
        out, self._pending = self._pending, []
        return out

    @staticmethod
    def replacement_env(member: int) -> dict[str, str]:
        """What tells a new worker it joins a running elastic job, and under which id."""
        return {"MICRODDP_ELASTIC_ID": str(member), "MICRODDP_ELASTIC_JOIN": "1"}

    def close(self) -> None:
        """Let go of the store connection."""
        if self._store is not None:
            self._store.close()
