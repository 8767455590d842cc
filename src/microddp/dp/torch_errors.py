"""Errors that are microddp's and torch's at once: frameworks written for PyTorch's DDP catch
the type torch raises (`except TypeError`, `assertRaisesRegex(ValueError, ...)`), and match
torch's phrase; microddp's users catch `MicroDDPError` and want a sentence that says what to
do. Each class here is both, and each message starts with torch's phrase, then ours.

MicroDDPError is already a RuntimeError, so where torch raises RuntimeError the message is
all that needs torch's words; these classes cover torch's TypeError and ValueError.
"""

from __future__ import annotations

from ..errors import MicroDDPError


class DDPTypeError(MicroDDPError, TypeError):
    """Where torch's DDP raises TypeError (a comm hook that is not callable)."""


class DDPValueError(MicroDDPError, ValueError):
    """Where torch's DDP raises ValueError (a comm hook's annotations, a logging rate)."""


def torch_says(phrase: str, advice: str) -> str:
    """torch's `phrase` (what its users match), then microddp's `advice` (what to do)."""
    return f"{phrase} {advice}"
