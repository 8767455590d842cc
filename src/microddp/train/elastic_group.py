"""Who is in an elastic job now: generations of members, heartbeats, fencing, all in the store.

`microddp train --elastic` forms a new process group whenever a member is lost, without a
coordinator process: the job's store (served by `microddp run`, so it outlives any rank, rank
0 included; under torchrun, whose agent restarts every worker on a failure, this is untried)
holds everything. Each membership is a *generation* g:
its member ids are written once, by compare-and-set, at `elastic/g{g}/members`, and its gloo
group meets under the prefix `elastic/g{g}/pg`, so nothing of an old group mixes with a new.

A member that sees its group fail announces itself for generation g+1 with the step it
completed; the first to see every old member either announced or dead (its heartbeat counter
stalled, or the launcher marked it) writes the list, and everyone reads that one list. A rank
left out (frozen by SIGSTOP, then woken) finds itself missing from the list it reads: it is
fenced, and exits without writing anything of the new generation. A rank frozen inside a
collective is noticed by the others' heartbeat watch, which ends their wait on the group.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import MicroDDPError
from ..launch.elastic_watch import dead_key

PREFIX = "elastic"
HEARTBEAT_S = 0.1  # how often a member bumps its counter and reads the others'
# A counter still for this long is a member that is gone (frozen; a dead one is marked by the
# launcher, or fails gloo's connections, sooner). Verdicts restart whenever a group forms
# (forming holds the GIL); a live rank taken for frozen costs one regrouping, not correctness.
STALE_S = 1.0
POLL_S = 0.0005  # how often a waiting collective looks at the heartbeat verdict


class MemberLost(RuntimeError):
    """A member of the current generation stopped beating during a collective."""


class Fenced(MicroDDPError):
    """This rank was left out of the newest generation: it must stop and write nothing."""


class Membership:
    """This rank's view of the elastic job: its id, the generation it is in, its members."""

    def __init__(self, store: dist.Store, me: int, timeout_s: float) -> None:
        self.store, self.me, self.timeout_s = store, me, timeout_s
        self.gen, self.members = -1, []
        self.pg = None  # this generation's gloo group
        self.suspect = False  # the heartbeat watch found a member of this generation gone
        self._in_flight = None  # a call given up on (MemberLost)
        self._window = 0  # bumped each time a group forms: heartbeat verdicts start afresh
        self.abandoned: list = []  # groups left with a call in flight, and those calls
        self.absorbed = 0  # replacements registered before the current generation formed
        self.joining = 0  # replacements registered so far (the heartbeat thread reads it)
        self._seen: dict[int, tuple[int, float]] = {}  # id -> (counter, when it last moved)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="microddp-elastic-heartbeat")

    # -- keys -----------------------------------------------------------------------------
    def _key(self, *parts) -> str:
        return "/".join([PREFIX, *map(str, parts)])

    # -- heartbeats ------------------------------------------------------------------------
    def start(self, members: list[int]) -> None:
        """Begin beating and watching, in generation 0 with `members`."""
        self.store.add(self._key("hb", self.me), 1)
        self.store.compare_set(self._key("gen"), "", "0")
        self._set_members(0, members)
        self._beat.start()

    def _set_members(self, gen: int, members: list[int]) -> None:
        with self._lock:
            self.gen, self.members, self.suspect = gen, list(members), False
            now = time.monotonic()
            self._seen = {m: self._seen.get(m, (-1, now)) for m in members}

    def _heartbeat(self) -> None:
        # A thread of its own with its own store connection (AuthStore keeps one per thread):
        # the main thread may sit in a collective for as long as the group's timeout.
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.add(self._key("hb", self.me), 1)
                self.joining = int(self.store.add(self._key("joining"), 0))
                with self._lock:
                    watched, gen, window = list(self._seen), self.gen, self._window
                now = time.monotonic()
                for m in watched:
                    count = self.store.add(self._key("hb", m), 0)  # add 0: a read that never waits
                    with self._lock:
                        last = self._seen.get(m)
                        if last is not None and count != last[0]:
                            self._seen[m] = (count, now)
                # A group another member has left is broken too: stop waiting on it now.
                lost = (self.store.check([self._key(f"g{gen}", "broken")])
                        or any(self.gone(m) for m in watched if m != self.me))
                with self._lock:  # no verdict from before the group formed, or another one
                    if (self.gen, self._window) == (gen, window):
                        self.suspect = lost
            except Exception:  # noqa: BLE001 (the store went away: the job is ending)
                if self._stop.is_set():
                    return

    def gone(self, member: int) -> bool:
        """Whether `member` has stopped beating, or the launcher saw its process end."""
        if member == self.me:
            return False
        with self._lock:
            last = self._seen.get(member)
        stalled = last is not None and time.monotonic() - last[1] > STALE_S
        return stalled or self.store.check([dead_key(member)])

    def wait(self, work) -> None:
        """Wait for `work` of this generation's group; raise MemberLost as soon as the
        heartbeat watch finds a member gone (a frozen member never makes gloo fail: only its
        timeout would, and gloo's abort does not end a wait)."""
        while not work.is_completed():
            if self.suspect:
                self._in_flight = work  # still running: the group must outlive it
                raise MemberLost(f"a member of generation {self.gen} stopped beating")
            time.sleep(POLL_S)
        work.wait()  # raises the group's error, if the call failed

    # -- groups ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's place in the current generation (its slice of every global batch)."""
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        """How many members the current generation has."""
        return len(self.members)

    @property
    def leader(self) -> bool:
        """The lowest id of the generation: the one that prints, logs and saves."""
        return self.members[0] == self.me

    def form(self) -> None:
        """Form this generation's gloo group (under its own prefix of the store). A group of
        its own, not torch's default one: a broken group can then be left while a call of
        it still waits on a frozen peer, which destroying the default group would wait for."""
        prefixed = dist.PrefixStore(self._key(f"g{self.gen}", "pg"), self.store)
        self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size,
                                        timedelta(seconds=self.timeout_s))
        # Forming holds the GIL while the members connect, so heartbeats pause meanwhile (the
        # slowest member's start-up): every member starts from a fresh window once formed.
        with self._lock:
            now = time.monotonic()
            self._seen = {m: (count, now) for m, (count, _) in self._seen.items()}
            self.suspect, self._window = False, self._window + 1

    def leave_group(self) -> None:
        """Let go of the current group. One with a call still in flight is kept referenced
        (its thread waits out gloo's timeout): freeing it would join that thread now."""
        if self._in_flight is not None:
            self.abandoned.append((self.pg, self._in_flight))
        self.pg, self._in_flight = None, None

    def reform(self, completed: int, broken: bool = True) -> dict[int, int]:
        """Leave the broken group and join the next generation; return every new member's
        completed step. Raises Fenced if the next generation was formed without this rank."""
        if broken:  # not when growing: then every member is at the same step boundary
            self.store.set(self._key(f"g{self.gen}", "broken"), "1")
        self.leave_group()
        gen = self.gen + 1
        while True:
            self.store.set(self._key(f"g{gen}", "in", self.me), str(completed))
            members = self._decide(gen)
            if self.me not in members:
                raise Fenced(f"fenced out: generation {gen} formed without id {self.me} "
                             f"(members {members})")
            if self.store.check([self._key(f"g{gen + 1}", "members")]):
                gen += 1  # already superseded while we were away: keep up
                continue
            self._set_members(gen, members)
            self.store.set(self._key("gen"), str(gen))
            steps = {m: int(self.store.get(self._key(f"g{gen}", "in", m))) for m in members}
            self.form()
            return steps

    def _decide(self, gen: int) -> list[int]:
        """The members of generation `gen`: decided once by whoever gets there first (the old
        members that announced themselves, and the joiners registered so far)."""
        where = self._key(f"g{gen}", "members")
        deadline = time.monotonic() + 2 * self.timeout_s + STALE_S
        while not self.store.check([where]):
            announced = [m for m in self.members
                         if self.store.check([self._key(f"g{gen}", "in", m)])]
            waiting = [m for m in self.members if m not in announced and not self.gone(m)]
            if not waiting or time.monotonic() > deadline:
                upto = int(self.store.add(self._key("joining"), 0))
                joiners = [int(self.store.get(self._key("joiner", i)))
                           for i in range(self.absorbed + 1, upto + 1)]
                joiners = [j for j in joiners if j not in announced and not self.gone(j)]
                self.store.compare_set(where, "", json.dumps(
                    {"members": sorted(announced) + joiners, "absorbed": upto}))
                break
            time.sleep(0.02)
        decided = json.loads(self.store.get(where))
        self.absorbed = decided["absorbed"]
        return decided["members"]

    def join_pending(self) -> bool:
        """Whether a replacement has registered since the last generation formed (what the
        heartbeat thread last read: no store call on the training path)."""
        return self.joining > self.absorbed

    def join(self) -> dict[int, int]:
        """A replacement's way in: register, wait for a generation that lists this id (the
        members form it at a step boundary), join its group; every member's completed step."""
        self.store.add(self._key("hb", self.me), 1)
        slot = int(self.store.add(self._key("joining"), 1))
        self.store.set(self._key("joiner", slot), str(self.me))
        self._beat.start()
        deadline = time.monotonic() + 60 * self.timeout_s
        while time.monotonic() < deadline:
            newest = int(self.store.get(self._key("gen")))
            for gen in (newest, newest + 1):  # the members may have moved "gen" on already
                where = self._key(f"g{gen}", "members")
                if not self.store.check([where]):
                    continue
                decided = json.loads(self.store.get(where))
                if self.me in decided["members"]:
                    self.absorbed = decided["absorbed"]
                    self.store.set(self._key(f"g{gen}", "in", self.me), "-1")
                    self._set_members(gen, decided["members"])
                    steps = {m: int(self.store.get(self._key(f"g{gen}", "in", m)))
                             for m in decided["members"]}
                    self.form()
                    return steps
                if slot <= decided["absorbed"]:
                    raise Fenced(f"generation {gen} formed without replacement id "
                                 f"{self.me}")
            time.sleep(0.05)
        raise Fenced(f"replacement id {self.me} was not taken in within "
                     f"{60 * self.timeout_s:g} s")

    def check_current(self) -> None:
        """Raise Fenced if a newer generation has formed (without this rank, or it would have
        left this one): what a rank frozen and woken finds before it writes anything."""
        newest = int(self.store.get(self._key("gen")))
        if newest != self.gen:
            raise Fenced(f"fenced out: generation {newest} formed without id {self.me} (it "
                         f"was in generation {self.gen})")

    def stop(self) -> None:
        """Stop beating, then leave the group."""
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(timeout=2)
        self.leave_group()


def member_id() -> int:
    """This process's id in the elastic job: its launcher rank (a replacement gets a new one)."""
    return int(os.environ.get("MICRODDP_ELASTIC_ID", os.environ.get("RANK", "0")))
