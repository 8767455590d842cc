"""The error types microddp raises for problems a user can fix, and the exit code of each."""

from __future__ import annotations


class MicroDDPError(RuntimeError):
    """Something went wrong that the user can act on.

    The message says what happened and what to do; the CLI prints it on one line and exits
    with `exit_code`: 2, a usage error, which `microddp run --max-restarts` never restarts
    (running the same input again would fail the same way).
    """

    exit_code = 2


class PeerError(MicroDDPError):
    """Another rank crashed, left or stalled (a hang report, a lost shared-memory peer).

    Not this rank's input: exit code 1, so a launcher with restarts left does restart the job.
    """

    exit_code = 1
