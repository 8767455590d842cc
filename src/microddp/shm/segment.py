"""Same-host shared memory between the ranks of one group: a segment, its counters, its lifecycle.

A segment is a file in /dev/shm that every rank of the group maps (mmap, MAP_SHARED), seen as
bytes (a torch tensor, for the data) and as 64-bit words (a memoryview, for the counters).

Lifecycle, because a segment outlives a crashed process unless somebody removes it:
- its name carries the creator's pid namespace and pid (`microddp-shm-<ns>-<pid>-<token>`);
- it is unlinked as soon as every rank of the group has mapped it (`attach`), so after that
  the kernel frees it when the last mapping goes, whatever way the processes end (SIGKILL
  included): only a crash inside the short attach window can leave one behind, and
- `sweep()` (run once per process, before its first segment) removes the segments of this
  pid namespace whose creator is no longer alive.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence

import torch

from ..errors import PeerError

# How the counters wait, and why the order of their stores and loads is safe (moved from the module's docstring):
#
# Counters: each rank writes only its own counters (one 64-byte line each, so two ranks never
# write the same cache line), and only ever increases them; the others read them. A waiting rank
# spins briefly, then sleeps in the kernel on a futex beside the counter (a 32-bit "bell" the
# poster rings after each post), so a rank on a busy host is woken the moment its peer posts,
# as a blocked socket read is, rather than when its next time slice comes. The futex is a system
# call through ctypes and libc (no compiler). Every LIVENESS_S it checks a deadline and whether
# its peers are still alive, and raises a MicroDDPError that names the missing ranks instead of
# waiting for ever.
#
# Memory ordering: a rank writes its data (torch ops), then its counter (one aligned 8-byte
# store), then rings the bell; a reader reads the bell, then the counter, then the data (and
# sleeps only if the bell still holds what it read: the kernel checks that). The wake-up is a
# system call, and under load every system call is a moment the kernel may run someone else,
# so a poster makes it only when a rank says it is asleep (a flag in that rank's line, raised
# before it reads the counter a last time): poster and sleeper each store, then `fence()`,
# then read the other's word, so at least one of them sees the other's store and no wake-up
# is lost. That is correct on x86-64, whose
# total store order keeps stores in order and loads in order, and where each torch op is an
# opaque call the compiler cannot move a load or store across (a multi-threaded op joins its
# threads first, a full fence). Weakly ordered CPUs (ARM, POWER) need fences that Python cannot
# issue, so `supported()` is False there and microddp keeps gloo unless told otherwise.

SHM_DIR = "/dev/shm"
PREFIX = "microddp-shm-"
LINE_WORDS = 8  # 64 bytes: one cache line per counter
# Busy reads before anything else (~1 us): a peer posting at this very moment.
SPINS = 20
# Then a wait keeps reading for up to a budget of time before it sleeps, and the budget adapts
# (per row of counters): doubled, up to SPIN_MAX_S, when a spin saw the post; halved, down to
# SPIN_MIN_S, when it spun in vain and slept. Sleeping costs both ranks a wake-up per call
# (the poster's system call, the sleeper's trip through the scheduler), which on a quiet host
# is most of a small all-reduce (docs/measured/04c-shared-memory.md); spinning in vain costs
# a core its peer may need on a loaded one, which the halving gives back within a few calls.
SPIN_MAX_S = 30e-6
SPIN_MIN_S = 2e-6
LIVENESS_S = 0.2  # how often a sleeping wait checks its deadline and that its peers are alive
_SYS_FUTEX = 202  # x86-64's number (supported() requires x86-64)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released during the call


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep until woken, `timeout_s` passes, or the word at `address` is not `expected`."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(ts), None, 0)


def _futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1),
                  None, None, 0)


# A full memory barrier without a system call: a locked compare-and-swap, which is what
# pthread_spin_trylock is on x86-64 (glibc: `lock cmpxchg`, executed whether or not it takes
# the lock; musl alike), and a locked instruction orders every load and store around it.
# Python has no fence of its own; the lock word is this process's. Where libc does not export
# it, a futex wake of a word nobody waits on does the same, at a system call's price: the
# kernel's futex_wake runs a full barrier (smp_mb) before it looks for waiters.
_fence_word = ctypes.c_int(0)
_fence_ref = ctypes.byref(_fence_word)
try:  # through PyDLL, which keeps the GIL: letting go of it for one instruction would invite
    # another thread (DDP's lane) in, and cost more than the fence
    _fence_call = ctypes.PyDLL(None).pthread_spin_trylock
except AttributeError:  # pragma: no cover (every libc we know exports it)
    _fence_call = None


def _fence_by_wake() -> None:  # pragma: no cover (where libc lacks pthread_spin_trylock)
    _futex_wake(ctypes.addressof(_fence_word))


# fence(): make this thread's earlier stores visible to every CPU before its later loads. The
# ctypes function bound to its argument, called with no Python frame in between (a post is on
# every collective's critical path).
fence: Callable[[], object] = (functools.partial(_fence_call, _fence_ref)
                               if _fence_call is not None else _fence_by_wake)


# Set by the hang monitor while it runs (it sits above this layer): turns the reason a wait
# failed into the report of where every rank is.
_reporter: Callable[[str], str] | None = None


def set_reporter(reporter: Callable[[str], str] | None) -> None:
    """Install the function that turns a failed wait's message into the hang report (the monitor's), or None."""
    global _reporter
    _reporter = reporter


def supported() -> bool:
    """Whether this host can run the transport as designed: /dev/shm, x86-64 ordering."""
    return (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
            and platform.machine().lower() in ("x86_64", "amd64"))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pid_namespace() -> str:
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())
    except OSError:
        return "0"


def host_identity() -> str:
    """What ranks compare to learn that they share this host's /dev/shm: the kernel's boot id,
    the /dev/shm file system and the pid namespace (pids are checked for liveness). Empty when
    it cannot be told (no /proc): then no rank will choose shared memory on its own."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}/{st.st_dev}:{st.st_ino}/{_pid_namespace()}"


def alive(pid: int) -> bool:
    """Whether process `pid` (of this pid namespace) still runs; a zombie does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def segment_name() -> str:
    """A fresh segment name: our prefix, the pid namespace and pid (so a sweep can tell a dead owner), and random bits."""
    return f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"


def sweep(directory: str | None = None) -> list[str]:
    """Remove this user's microddp segments left by dead processes of this pid namespace (a
    crash between creating a segment and every rank attaching it) from `directory` (SHM_DIR).
    Returns their names."""
    directory = SHM_DIR if directory is None else directory
    removed = []
    ns, uid = _pid_namespace(), os.getuid()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        parts = entry.name[len(PREFIX):].split("-")
        try:
            owned = entry.stat(follow_symlinks=False).st_uid == uid
        except OSError:
            continue
        if len(parts) != 3 or parts[0] != ns or not parts[1].isdigit() or not owned:
            continue
        if not alive(int(parts[1])):
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:
                pass
    return removed


class Segment:
    """One mapping of a /dev/shm file: `data` (uint8 tensor) and `words` (int64 memoryview)."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name, self.size = name, size
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                # Reserve the memory now (zero-filled: every counter starts at 0): a /dev/shm
                # too small for it fails here, with an error, rather than with a SIGBUS on
                # the first write past its end, as a file merely truncated to size would.
                os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name may go at once
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.words = memoryview(self._mm).cast("q")
        self.bells = memoryview(self._mm).cast("i")  # 32-bit words: what a futex watches
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)

    def unlink(self) -> None:
        """Remove the segment's name from /dev/shm (the mappings stay valid); a second unlink is a no-op."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Let go of the mapping. It is unmapped when the last tensor viewing it goes (torch
        holds the mmap object, not its memory: closing the mmap under a live view would
        leave that view pointing at nothing), and the memory is freed with the last mapping
        of any rank."""
        self.data = self._mm = None


_ASLEEP = 2  # a line's third word: its rank sleeps in a wait on this row of counters


class Flags:
    """Per-rank counters in a segment: each rank posts its own, and waits for the others.
    A counter is the first 8 bytes of its rank's 64-byte line; its bell the next 4; the
    third word says its rank is asleep waiting for another's counter of this row."""

    def __init__(self, segment: Segment, first_word: int, rank: int, size: int,
                 pids: Sequence[int], gone: Flags | None = None) -> None:
        self.words, self.bells, self.address = segment.words, segment.bells, segment.address
        self.rank, self.size, self.pids = rank, size, list(pids)
        self.index = [first_word + r * LINE_WORDS for r in range(size)]
        self.others = [i for r, i in enumerate(self.index) if r != rank]
        # What post() touches, worked out once: posts sit on the critical path of every
        # collective, where each Python step costs several microseconds (caches cold after
        # the data moved; measured, agreement/early.py).
        self._mine = self.index[rank]
        self._bell = 2 * self._mine + 2  # the 32-bit word after the counter
        self._asleep = [i + _ASLEEP for i in self.others]
        self.gone = gone
        # Spinning only pays when every rank has a core: with more ranks than cores, the
        # rank being waited for may need this very core to get there.
        self.spins = SPINS if size <= _cores() else 0
        self.spin_s = SPIN_MAX_S if self.spins else 0.0  # the adaptive budget (see SPIN_MAX_S)

    def post(self, value: int) -> None:
        """Post this rank's step `value` and wake any rank sleeping on it. After it, the post
        is visible to every rank before this one's next read (`fence`)."""
        words, bells, bell = self.words, self.bells, self._bell
        words[self._mine] = value
        bells[bell] = (bells[bell] + 1) & 0x7FFFFFFF
        fence()
        for j in self._asleep:
            if words[j]:
                _futex_wake(self.address + 4 * bell)
                return

    def get(self, rank: int) -> int:
        """The last step `rank` posted."""
        return self.words[self.index[rank]]

    def wait(self, value: int, deadline_s: float, what: str, yielding: bool = False) -> None:
        """Until every rank has posted `value` or more. `yielding`: release the GIL between
        reads from the first one (on a thread beside a training loop, whose Python hooks need
        it); otherwise spin first, as a rank with nothing else to do should."""
        words = self.words
        if not yielding and self.spins:  # (the lane's thread must let go of the GIL at once)
            if len(self.others) == 1:  # two ranks: one line to watch
                i = self.others[0]
                for _ in range(self.spins):
                    if words[i] >= value:
                        return
            else:
                for _ in range(self.spins // len(self.others)):
                    if min(words[i] for i in self.others) >= value:
                        return
            if self._spin(value):
                return
        self._wait_slowly(value, deadline_s, what)

    def _spin(self, value: int) -> bool:
        """Read the others' counters for up to the budget; whether they all reached `value`.
        Adapts the budget (SPIN_MAX_S): doubled on success, halved on a spin in vain."""
        budget = self.spin_s
        if budget <= 0.0:
            return False
        words, others = self.words, self.others
        clock = time.perf_counter
        end = clock() + budget
        while True:
            for i in others:
                if words[i] < value:
                    break
            else:
                self.spin_s = min(SPIN_MAX_S, budget * 2)
                return True
            if clock() > end:
                self.spin_s = max(SPIN_MIN_S, budget / 2)
                return False

    def _wait_slowly(self, value: int, deadline_s: float, what: str) -> None:
        words, bells, others = self.words, self.bells, self.others
        start = time.monotonic()
        check_at = start + LIVENESS_S
        while True:
            late = [i for i in others if words[i] < value]
            if not late:
                return
            i = late[0]
            bell = 2 * i + 2
            asleep = self.index[self.rank] + _ASLEEP
            words[asleep] = 1  # raised, then fenced, before the last read (module docstring)
            fence()
            rung = bells[bell]  # the bell first, then the counter: see the module's docstring
            if words[i] < value:
                _futex_wait(self.address + 4 * bell, rung, LIVENESS_S)
            words[asleep] = 0
            now = time.monotonic()
            if now >= check_at:
                check_at = now + LIVENESS_S
                # Only a rank that has not posted counts: one may post its last step, then
                # leave, while another is merely slow.
                lost = [r for r in self.lost() if self.get(r) < value]
                if lost:
                    self.fail(value, what, f"rank(s) {lost} of the group exited", lost)
                if now - start > deadline_s:
                    late = [r for r in range(self.size) if self.get(r) < value]
                    self.fail(value, what, f"timed out after {deadline_s:g} s waiting for "
                              f"rank(s) {late}", late)

    def lost(self) -> list[int]:
        """Group ranks that left (closed the transport) or whose process is gone."""
        return [r for r, pid in enumerate(self.pids) if r != self.rank and (
            (self.gone is not None and self.gone.get(r)) or not alive(pid))]

    def fail(self, value: int, what: str, why: str, ranks: list[int]) -> None:
        """Raise (on this rank) the error for a wait that failed: which step, why, which ranks; with the hang report when one is installed."""
        text = (f"shared-memory {what} (step {value}) on group rank {self.rank}: {why}; every "
                "rank must call the same collectives in the same order; look at the rank(s) "
                "named (a crash or an exit there is the cause)")
        if _reporter is not None:
            try:
                text = _reporter(text) + f"\n({text})"
            except Exception:  # noqa: BLE001 (the report is a courtesy: our own words stand)
                pass
        raise PeerError(text)
