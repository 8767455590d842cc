"""Which loop the ring all-reduce runs on gloo, chosen by chunk size and world size.

The loops themselves are in ring.py (plain, lookahead, preposted), _pipeline.py and
_pair.py; what each costs on this 2-core host, measured interleaved against gloo, decides the
thresholds below (chapter 4 tells the whole story).
"""

from __future__ import annotations

from ._pipeline import segments_per_chunk

# On gloo, chunks up to this size go, on more than 2 ranks, with every receive posted before
# the first send (one round trip less per step, most of a small message's cost); larger ones
# go plainly, one message per step, send first; from PIPELINE_MIN_CHUNK on, through the
# pipeline (below). Both rings from kept views (_plan.py), interleaved: on 4 ranks, posting
# every receive first took 0.62-0.90x gloo's time at 64 KiB-1 MiB tensors where the plain
# ring took 1.03-1.34x, and on 3 ranks 0.78-1.05x against 1.12-1.16x. On 2 ranks, with only
# two steps, the plain ring won at 15 of 16 points (1 KiB-1 MiB tensors, four runs:
# 0.79-1.00x against 0.90-1.15x): there the preposted ring's copies out of its inbox and its
# wait on its sends cost more than the round trip saves (chapter 4).
PREPOST_MAX_CHUNK = 256 << 10
# The plain ring posts each step's next receive before adding (planned_ring_all_reduce_) on
# more than 2 ranks. Measured interleaved against posting each receive with its own send: on
# 3 and 4 ranks it won at every size tried (2-32 MiB tensors: 0.98-1.10x gloo's time against
# 1.09-2.06x); on 4 ranks the send still goes before the receive (send first: 1.00-1.09x
# against 1.02-1.12x in two runs).
# On more than 2 ranks, chunks from PIPELINE_MIN_CHUNK on go through the pipeline
# (_pipeline.py) in segments of at most PIPELINE_SEGMENT, with up to PIPELINE_WINDOW receives
# posted ahead: a segment is added and passed on while the next ones arrive, and up to 64
# messages ahead no sender waits for its receiver to announce a buffer. A message costs
# about 80 us here (thread wake-ups, not bytes), so segments stay large. Measured
# interleaved against the lookahead ring, ratio to gloo's time, in two sessions: on 4 ranks at 8-64 MiB tensors, better in 21
# of 22 comparisons, by up to 7% (e.g. 8 MiB: 1.10-1.14x against 1.16-1.17x); on 3 ranks at
# 12-48 MiB better in 3 of 3, at 6 MiB in 1 of 2. A window of 16 lost to 64 at 32 and 64 MiB
# on 4 ranks, and 1 MiB segments (window 16) lost at every size. The pipeline keeps one
# scratch segment per reduce-scatter receive in flight: about (p-1)/p of the tensor, at most
# PIPELINE_WINDOW segments (128 MiB by default). In whole benchmark runs the gain is smaller
# than in these direct comparisons: level at 8 MiB, ahead at 16-64 MiB (chapter 4).
PIPELINE_MIN_CHUNK = 2 << 20
PIPELINE_SEGMENT = 2 << 20
PIPELINE_WINDOW = 64
# On 2 ranks, chunks from PAIR_MIN_CHUNK on go through the pair loop (_pair.py): both
# exchanges cut into segments of at most PAIR_SEGMENT, all of the first exchange's posted at
# once. Measured interleaved against the loops it replaced (the plain ring, the receive-first
# lookahead and the 1 MiB pipeline), ratio to gloo's time: at 16 MiB tensors 0.93-0.98x
# against 1.00-1.07x in five runs, at 32 MiB 0.93-0.96x against 1.02-1.05x in three, at 64
# MiB 0.94-0.96x against 0.95-1.03x in three; at 8 MiB (two segments of 2 MiB) better in 10
# of 14 runs, by 3% in the median. Smaller pieces lost: 1 MiB segments of a 2 MiB chunk took
# 1.18x (two runs) against the plain ring's 1.07-1.13x.
PAIR_MIN_CHUNK = 4 << 20
PAIR_SEGMENT = 2 << 20

def posting(chunk_bytes: int, p: int, segment_bytes: int | None = None) -> str:
    """How the ring on gloo orders its messages for chunks of `chunk_bytes` on `p` ranks:
    "pair" (2 ranks, large chunks: _pair.py), "pipeline" (more ranks, large chunks, or
    segments the caller asked for: _pipeline.py), "prepost" (every receive before the first
    send; more than 2 ranks only), "lookahead" (each next receive before the add; more than 2
    ranks), or "plain" (each receive posted beside its own send). A `segment_bytes` smaller
    than a chunk selects the pipeline; one as large goes whole. The thresholds are explained
    at the top of this file."""
    if segment_bytes is None:
        if p == 2 and chunk_bytes >= PAIR_MIN_CHUNK:
            return "pair"
        if p > 2 and chunk_bytes >= PIPELINE_MIN_CHUNK:
            return "pipeline"
    elif chunk_bytes > segment_bytes:
        return "pipeline"
    if chunk_bytes <= PREPOST_MAX_CHUNK and p > 2:
        return "prepost"
    return "lookahead" if p > 2 else "plain"


def widest_chunk_bytes(numel: int, p: int, element_size: int) -> int:
    """Bytes of the widest of the p near-equal chunks that bounds() cuts `numel` elements into."""
    return -(-numel // p) * element_size


def pair_segments(chunk_bytes: int, element_size: int) -> int:
    """Segments per step of the pair loop for chunks of `chunk_bytes` (at most PAIR_SEGMENT)."""
    return segments_per_chunk(chunk_bytes // element_size, element_size, PAIR_SEGMENT)


def ring_segments(nbytes: int, p: int, element_size: int = 4,
                  segment_bytes: int | None = None) -> int:
    """Messages per ring step on gloo for an all-reduce of `nbytes` on `p` ranks: 1 when chunks
    go whole, else the segments per chunk of the pair loop or of the pipeline (what the cost
    model needs to know)."""
    chunk_bytes = widest_chunk_bytes(nbytes // element_size, p, element_size)
    how = posting(chunk_bytes, p, segment_bytes)
    if how == "pair":
        return pair_segments(chunk_bytes, element_size)
    if how == "pipeline":
        return segments_per_chunk(chunk_bytes // element_size, element_size,
                                  segment_bytes or PIPELINE_SEGMENT)
    return 1
