"""The monitor that microddp.init() starts on its own: whether, and with what stall threshold.

On by default because a hang is where a distributed job is hardest to debug and the monitor is
cheap where it matters: some Python per collective, since this monitor leaves the waits to the
process group (interrupt_pays); nothing measurable on a DDP step, though on a loaded machine a
tiny all-reduce pays far more (docs/07-observability.md has the runs). Off with
init(monitor=False) or MICRODDP_MONITOR=0; the argument wins over the variable.
"""

from __future__ import annotations

import os

from ..errors import MicroDDPError

ENV = "MICRODDP_MONITOR"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
# The report needs a few seconds after the stall (every rank answers through the store within
# a poll or two, the reporter waits up to monitor.enable's answer_timeout of 5 s for silent
# ones). Leave that much of the process group's timeout, so the report comes before gloo's own
# timeout error (and NCCL's watchdog) on any rank; a short timeout keeps a fifth of itself.
REPORT_MARGIN_S = 8.0


def wanted(monitor: bool | None) -> bool:
    """init's `monitor` argument if given, else MICRODDP_MONITOR (unset: on)."""
    if monitor is not None:
        return bool(monitor)
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", *_ON):
        return True
    if value in _OFF:
        return False
    raise MicroDDPError(f"{ENV}={os.environ[ENV]!r} is neither on nor off; set it to 0 to turn "
                        "the hang monitor off or 1 (the default) to keep it on")


def stall_seconds(process_group_timeout_s: float) -> float:
    """How long a collective may take before the ranks are asked where they are: below the
    process group's timeout by the time the report needs (a fifth of a short timeout)."""
    t = process_group_timeout_s
    return max(t - REPORT_MARGIN_S, 0.8 * t)


def interrupt_pays(monitor_timeout_s: float, group_timeout_s: float | None) -> bool:
    """Whether to wait on blocking gloo calls with the monitor's timeout (a thread hand-over
    per call, see patch.py): only if the process group's own timeout would end a stalled wait
    much later (over twice REPORT_MARGIN_S) than the watchdog's report. Not for init()'s own
    monitor, which asks REPORT_MARGIN_S (or less) before that timeout. Unknown (None): yes,
    the safe side."""
    return group_timeout_s is None or group_timeout_s - monitor_timeout_s > 2 * REPORT_MARGIN_S
