"""Course chapter 11 runs as a learner runs it, and prints the right numbers."""

from __future__ import annotations

from pathlib import Path

from script_runner import output

ROOT = Path(__file__).resolve().parents[1]


def test_hierarchical_sends_fewer_bytes_between_hosts_for_the_same_sum():
    out = output(ROOT / "course/11_many_hosts/hierarchical.py")
    # flat ring on 4 ranks: ranks 1 and 3 send 2(p-1)/p = 1.5 x 4 MiB each to the other host
    assert ("flat ring:    12.00 MiB cross between the hosts (ranks 1, 3 send 6.00 MiB each)"
            in out), out
    # hierarchical: each rail all-reduces a 2 MiB chunk on 2 ranks: 2 MiB sent per rank
    assert ("hierarchical: 8.00 MiB cross between the hosts (every rank sends 2.00 MiB on its "
            "rail)") in out, out
    assert "flat / hierarchical: 1.50 times the bytes between hosts" in out
    assert "same result, bit for bit: yes" in out
