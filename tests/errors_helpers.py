"""What a call says when it refuses, for tests that compare messages across ranks (not a test
module itself)."""

from microddp import MicroDDPError


def message(fn) -> str:
    """The MicroDDPError `fn()` raises, as text, or "no error"; any other error propagates."""
    try:
        fn()
    except MicroDDPError as e:
        return str(e)
    return "no error"
