"""How two ranks move bytes: the send/recv interface the collectives are written against
(peers.py: `Peers`, a group seen from one rank, and its traffic counters) and a second
connection between two ranks so both directions move at once (duplex.py)."""
