"""Same-host shared memory, one room: how ranks of one host move data through memory they all
map, and how they wait for each other there.

From the bottom: segment.py (a segment in /dev/shm, per-rank counters with a deadline, the
memory ordering every writer keeps, the sweep of dead jobs' segments), attach.py (whether a
group's ranks all share this host, and setting its segment up, collectively), agreement.py
(the metadata check of a group's call, written and read in the segment), group.py (the
segment's layout and the algorithms: all-reduce, reduce-scatter, all-gather, broadcast),
lane.py (calls kept in order, async handles), checked.py (a call's agreement posted in the
synchronisation it makes anyway) and collectives.py (the shm_* collectives, one segment and
lane per group).

It sits between transport/ and collectives/: collectives/route.py chooses it for a group
whose ranks share this host, and microddp's torch backend (backend/) runs on it.
"""
