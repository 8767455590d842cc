"""The one error type microddp raises for problems a user can fix."""

from __future__ import annotations


class MicroDDPError(RuntimeError):
    """Something went wrong that the user can act on.

    The message says what happened and what to do; the CLI prints it on one line and exits 2.
    """
