"""Which loop the ring all-reduce runs (loops.py), chosen by chunk size and world size, and
how many messages a ring step sends under that choice (what the cost model needs).

The thresholds below come from measurements on a 2-core host, each loop timed interleaved
against gloo; chapter 4 (docs/04-allreduce-algorithms.md) tells the whole story.
"""

from __future__ import annotations


def segments_per_chunk(width: int, element_size: int, segment_bytes: int) -> int:
    """Segments of at most `segment_bytes` that cut the widest chunk (`width` elements);
    every chunk is cut into that many, so all ranks send the same number of messages."""
    return max(1, min(width, -(-width * element_size // segment_bytes)))



# On gloo, chunks up to this size go, on more than 2 ranks, with every receive posted before the
# first send (one round trip less per step, most of a small message's cost); larger ones go one
# message per step, send first, each next receive posted before the add (lookahead, below); from
# PIPELINE_MIN_CHUNK on, through the pipeline (below). Both rings from kept views (plan.py),
# interleaved: on 4 ranks, posting every receive first took 0.62-0.90x gloo's time at 64 KiB-1 MiB
# tensors where the plain ring took 1.03-1.34x, and on 3 ranks 0.78-1.05x against 1.12-1.16x. On 2
# ranks, with only two steps, the plain ring won at 15 of 16 points (1 KiB-1 MiB tensors, four runs:
# 0.79-1.00x against 0.90-1.15x): there the preposted ring's copies out of its inbox and its wait on
# its sends cost more than the round trip saves (chapter 4).
PREPOST_MAX_CHUNK = 256 << 10
# The ring posts each step's next receive before adding (lookahead, planned_ring_all_reduce_).
# Measured interleaved against posting each receive with its own send ("plain"): on 3 and 4
# ranks it won at every size tried (2-32 MiB tensors: 0.98-1.10x gloo's time against
# 1.09-2.06x); on 4 ranks the send still goes before the receive (send first: 1.00-1.09x
# against 1.02-1.12x in two runs). On 2 ranks the next receive is the gather's, into the
# chunk the first step is still sending (safe: see planned_ring_all_reduce_). Posted at
# once, it took 0.73-0.87x gloo's time against plain's 0.83-0.91x at 64 KiB-1 MiB tensors
# (four runs; level at 1 KiB), and won 8 of 10 comparisons at 1-2 MiB and 5 of 6 at 4 MiB,
# by 3.5% in the median. What it takes out is a wait with nothing on the wire: gloo holds
# each send until the receiver has announced its buffer.
# On more than 2 ranks, chunks from PIPELINE_MIN_CHUNK on go through the pipeline (loops.py) in
# segments of at most PIPELINE_SEGMENT, with up to PIPELINE_WINDOW receives posted ahead: a segment
# is added and passed on while the next ones arrive, and up to 64 messages ahead no sender waits for
# its receiver to announce a buffer. A message costs about 80 us here (thread wake-ups, not bytes),
# so segments stay large. Measured interleaved against the lookahead ring, ratio to gloo's time, in
# two sessions: on 4 ranks at 8-64 MiB tensors, better in 21 of 22 comparisons, by up to 7% (e.g. 8
# MiB: 1.10-1.14x against 1.16-1.17x); on 3 ranks at 12-48 MiB better in 3 of 3, at 6 MiB in 1 of 2.
# A window of 16 lost to 64 at 32 and 64 MiB on 4 ranks, and 1 MiB segments (window 16) lost at
# every size. The pipeline keeps one scratch segment per reduce-scatter receive in flight: about
# (p-1)/p of the tensor, at most PIPELINE_WINDOW segments (128 MiB by default). In whole benchmark
# runs the gain is smaller than in these direct comparisons: level at 8 MiB, ahead at 16-64 MiB
# (chapter 4).
PIPELINE_MIN_CHUNK = 2 << 20
PIPELINE_SEGMENT = 2 << 20
PIPELINE_WINDOW = 64
# On 2 ranks, chunks from PAIR_MIN_CHUNK on go through the pair loop (loops.py): both
# exchanges cut into segments of at most PAIR_SEGMENT, all of the first exchange's posted at
# once. Measured interleaved against the loops it replaced (the plain ring, the receive-first
# lookahead and the 1 MiB pipeline), ratio to gloo's time: at 16 MiB tensors 0.93-0.98x
# against 1.00-1.07x in five runs, at 32 MiB 0.93-0.96x against 1.02-1.05x in three, at 64
# MiB 0.94-0.96x against 0.95-1.03x in three. Below 8 MiB chunks the lookahead ring (above)
# won: at 8 MiB tensors (4 MiB chunks) 0.96-1.00x against the pair loop's 1.06-1.13x in three
# runs, and 5 of 7 in another series; at 12 MiB 0.99-1.01x against 1.00-1.02x in two. Smaller
# pieces lost: 1 MiB segments of a 2 MiB chunk took 1.18x (two runs) against the plain
# ring's 1.07-1.13x.
PAIR_MIN_CHUNK = 8 << 20
PAIR_SEGMENT = 2 << 20

# On 2 ranks with a connection per direction (transport/duplex.py), chunks go whole at every size, with
# both receives posted before the first send ("receive-first"): then every send finds its
# receiver ready, and writes while gloo's I/O thread reads the other direction on the other
# socket. Measured interleaved on 2 ranks (`/tmp` scripts, 60-300 calls per size), ratio to
# gloo's time: 0.59-0.78x at 64 KiB-8 MiB tensors, against 0.64-0.92x for the lookahead order
# on the same two connections, and 0.81-0.87x at 16-64 MiB, against 0.83-0.88x for the pair
# loop on them (2 MiB segments) and 0.86-0.90x with 1 MiB segments.


def posting(chunk_bytes: int, p: int, segment_bytes: int | None = None,
            duplex: bool = False) -> str:
    """How the ring on gloo orders its messages for chunks of `chunk_bytes` on `p` ranks:
    "receive-first" (2 ranks with a connection per direction: both receives, then the send),
    "pair" (2 ranks on one connection, large chunks: loops.py), "pipeline" (more ranks,
    large chunks, or segments the caller asked for: loops.py), "prepost" (every receive
    before the first send; more than 2 ranks only), or "lookahead" (each next receive
    before the add). It never picks "plain" (each receive posted beside its own send), which
    the ring's loop still runs when asked: the simplest order, for reading and comparing. A
    `segment_bytes` smaller than a chunk selects the pipeline; one as large goes whole. The
    thresholds are explained at the top of this file."""
    if segment_bytes is not None and chunk_bytes > segment_bytes:
        return "pipeline"
    if p == 2 and duplex:
        return "receive-first"
    if segment_bytes is None:
        if p == 2 and chunk_bytes >= PAIR_MIN_CHUNK:
            return "pair"
        if p > 2 and chunk_bytes >= PIPELINE_MIN_CHUNK:
            return "pipeline"
    if chunk_bytes <= PREPOST_MAX_CHUNK and p > 2:
        return "prepost"
    return "lookahead"


def widest_chunk_bytes(numel: int, p: int, element_size: int) -> int:
    """Bytes of the widest of the p near-equal chunks that bounds() cuts `numel` elements into."""
    return -(-numel // p) * element_size


def pair_segments(chunk_bytes: int, element_size: int) -> int:
    """Segments per step of the pair loop for chunks of `chunk_bytes` (at most PAIR_SEGMENT)."""
    return segments_per_chunk(chunk_bytes // element_size, element_size, PAIR_SEGMENT)


def ring_segments(nbytes: int, p: int, element_size: int = 4,
                  segment_bytes: int | None = None, duplex: bool = False) -> int:
    """Messages per ring step on gloo for an all-reduce of `nbytes` on `p` ranks: 1 when chunks
    go whole, else the segments per chunk of the pair loop or of the pipeline (what the cost
    model needs to know). `duplex`: whether 2 ranks have a connection per direction."""
    chunk_bytes = widest_chunk_bytes(nbytes // element_size, p, element_size)
    how = posting(chunk_bytes, p, segment_bytes, duplex)
    if how == "pair":
        return pair_segments(chunk_bytes, element_size)
    if how == "pipeline":
        return segments_per_chunk(chunk_bytes // element_size, element_size,
                                  segment_bytes or PIPELINE_SEGMENT)
    return 1
