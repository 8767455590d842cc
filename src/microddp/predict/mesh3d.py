"""Predict a GPT's training step on a dp x pp x tp mesh: time, bytes sent per axis, memory per
rank; and rank every mesh of a world size by predicted step time.

The step as train/strategies/mesh3d.py runs it: a replica's slice of the global batch is cut
into m micro-batches that a pipeline runs (GPipe or 1F1B take the same (m + pp - 1) slots of the
slowest stage); each slot is a stage's forward and backward of one micro-batch on 1/tp of its
weights, plus its tensor-parallel all-reduces (two per block forward, two backward, one for the
embedding, one for the head's input gradient, two small ones for the loss: tp/gpt.py's ledger)
and its boundary messages (one activation forward, one gradient backward). After the pipeline,
each rank's shards are all-reduced over its data-parallel group, not overlapped.

Compute is 6 x weights FLOPs per token plus attention's 12 x seq x d_model per token per block,
at the hardware's sustained rate. Communication is the alpha-beta model of collectives/cost.py
on the link the axis's group uses: ranks laid out TP innermost, PP outermost (comms/mesh3d.py),
a group stays inside a host of `per_host` ranks when its ranks span no more than that, else it
pays the link between hosts. Ranks of one host that outnumber its cores share them.

Memory per rank: this rank's parameters, gradients and optimizer state (fp32, SGD's momentum
4 bytes or Adam's moments 8 per parameter) and the activations the schedule holds (GPipe: m
micro-batches, 1F1B: pp on the first stage), Megatron's count for a block without sequence
parallelism, s b h (10 + 24/t + 5 a s / (h t)) half-precision bytes, doubled for fp32.

`cp` > 1 (pp 1, train/strategies/context.py's dp x cp x tp mesh): compute, TP traffic and
activations per rank fall as 1/cp; the ring's K/V and dK/dV hops (predict/context.py) add
their exposed part to the step, and each shard's gradient is all-reduced over CP before DP.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MicroDDPError
from .context import ring
from .step import Hardware, allreduce_time


@dataclass(frozen=True)
class GPTShape:
    """The sizes of a GPT (microddp.gpt.GPTConfig's), `batch` the global batch of sequences."""

    d_model: int
    n_layer: int
    n_head: int
    seq: int
    vocab: int = 256
    batch: int = 32

    @property
    def block_params(self) -> int:
        """Weights and biases of one block: attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, norms 4 d."""
        d = self.d_model
        return 12 * d * d + 13 * d

    @property
    def params(self) -> int:
        """The whole model (untied head)."""
        d = self.d_model
        return self.n_layer * self.block_params + 2 * self.vocab * d + self.seq * d + 2 * d


def blocks_per_stage(n_layer: int, pp: int) -> list[int]:
    """tp/stages.py's split: equal, the first stages one more."""
    base, extra = divmod(n_layer, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def meshes(world: int, shape: GPTShape, microbatches: int,
           cp: bool = False) -> list[tuple[int, ...]]:
    """Every (dp, pp, tp) of `world` ranks the GPT can take: tp divides the heads, pp at most
    the blocks, dp divides the batch and leaves each pipeline its micro-batches. With `cp`,
    (dp, pp, tp, cp) and also the context-parallel meshes the job runs: pp 1, the sequence
    dividing by 2 cp."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if shape.n_head % tp or pp > shape.n_layer or shape.batch % dp:
                continue
            if pp > 1 and shape.batch // dp < microbatches:
                continue
            out.append((dp, pp, tp, 1) if cp else (dp, pp, tp))
    if cp:
        out += [(world // (c * tp), 1, tp, c) for tp in range(1, world + 1)
                for c in range(2, world // tp + 1)
                if not world % (c * tp) and not shape.n_head % tp
                and not shape.seq % (2 * c) and not shape.batch % (world // (c * tp))]
    return out


def _link(span: int, per_host: int, intra: Hardware, inter: Hardware) -> Hardware:
    return intra if span <= per_host else inter


def predict_mesh(shape: GPTShape, dp: int, pp: int, tp: int, hw: Hardware, *,
                 microbatches: int = 1, per_host: int = 8, inter: Hardware | None = None,
                 schedule: str = "1f1b", optimizer_bytes: int = 8,
                 algorithm: str = "ring", cp: int = 1) -> dict:
    """One training step of `shape` on a dp x pp x tp mesh, each replica's sequences split
    over `cp` context-parallel ranks (rank order TP, CP, DP outermost; pp 1); seconds, bytes."""
    world = dp * pp * tp * cp
    if min(dp, pp, tp, cp) < 1 or shape.n_head % tp or pp > shape.n_layer or shape.batch % dp:
        raise MicroDDPError(f"the GPT (heads {shape.n_head}, blocks {shape.n_layer}, batch "
                            f"{shape.batch}) cannot take the mesh dp {dp} x pp {pp} x tp {tp}"
                            + (f" x cp {cp}" if cp > 1 else ""))
    if cp > 1 and (pp > 1 or shape.seq % (2 * cp)):
        raise MicroDDPError(f"cp {cp} needs pp 1 (pipeline stages with context parallelism are "
                            f"not built) and a sequence dividing by 2 x cp = {2 * cp}; got pp "
                            f"{pp}, sequence {shape.seq}")
    inter = inter or hw
    m = microbatches if pp > 1 else 1
    per_replica = shape.batch // dp
    if per_replica < m:
        raise MicroDDPError(f"{m} micro-batches need at least {m} sequences per replica, the "
                            f"mesh gives {per_replica}")
    d, s = shape.d_model, shape.seq
    tokens = per_replica * s / m / cp  # per micro-batch, this rank's (1/cp of each sequence)
    local = min(world, per_host)
    sharing = min(local, hw.cores) if hw.cores else 1
    rate = hw.flops / sharing if hw.cores else hw.flops
    if hw.rank_flops:
        rate = min(rate, hw.rank_flops)
    stretch = max(1.0, local / hw.cores) if hw.cores else 1.0  # more ranks than cores
    tp_hw = _link(tp, per_host, hw, inter)
    cp_hw = _link(cp * tp, per_host, hw, inter)  # a ring's ranks are tp apart
    dp_hw = _link(dp * cp * tp, per_host, hw, inter)
    pp_hw = _link(world, per_host, hw, inter)
    act = tokens * d * 4  # one micro-batch's residual stream, fp32
    counts = blocks_per_stage(shape.n_layer, pp)
    slots, tp_bytes, tp_time, stage_params, rings = [], [], [], [], []
    for st, blocks in enumerate(counts):
        first, last = st == 0, st == pp - 1
        flops = tokens * blocks * (6 * 12 * d * d + 12 * s * d)
        if last:
            flops += tokens * 6 * d * shape.vocab
        compute = flops / tp / rate * stretch
        reduces = [act] * (4 * blocks + (1 if first else 0) + (1 if last else 0))
        if last:
            reduces += [tokens * 4, tokens * 8]  # the loss: max, then the sums
        t_tp = sum(allreduce_time(b, tp, tp_hw, algorithm) for b in reduces) if tp > 1 else 0.0
        t_pp = 0.0
        if pp > 1:  # an activation out (not last), a gradient out (not first)
            msgs = (0 if last else 1) + (0 if first else 1)
            t_pp = msgs * (pp_hw.latency + act / pp_hw.bandwidth)
        rings.append(ring(per_replica / m, s, d, blocks, cp, tp, rate / stretch, cp_hw))
        slots.append(compute + t_tp * stretch + t_pp + rings[-1]["exposed_s"])
        tp_bytes.append(m * sum(2 * (tp - 1) / tp * b for b in reduces) if tp > 1 else 0.0)
        tp_time.append(m * t_tp)
        n = blocks * shape.block_params + (shape.vocab * d + s * d if first else 0) \
            + (shape.vocab * d + 2 * d if last else 0)
        stage_params.append(n / tp)  # norms and row biases are whole: a slight undercount
    pipeline_s = (m + pp - 1) * max(slots)
    biggest = max(range(pp), key=lambda i: stage_params[i])
    grads = stage_params[biggest] * 4
    dp_s = allreduce_time(grads, dp, dp_hw, algorithm) * stretch if dp > 1 else 0.0
    # finish_grads: each shard's gradient summed over the CP group (its ranks saw other tokens)
    cp_s = allreduce_time(grads, cp, cp_hw, algorithm) * stretch if cp > 1 else 0.0
    held = m if schedule == "gpipe" else min(m, pp)
    per_block = 2 * s * (per_replica / m) * d * (10 + 24 / tp + 5 * shape.n_head * s / (d * tp))
    activations = held * counts[0] * per_block / cp
    state = stage_params[biggest] * (4 + 4 + optimizer_bytes)
    return {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "world": world, "microbatches": m,
            "step_s": pipeline_s + cp_s + dp_s, "pipeline_s": pipeline_s, "dp_s": dp_s,
            "cp_s": cp_s, "cp_ring_bytes": m * max(r["bytes"] for r in rings),
            "cp_exposed_s": m * max(r["exposed_s"] for r in rings),
            "cp_grad_bytes": 2 * (cp - 1) / cp * grads if cp > 1 else 0.0,
            "tp_s": max(tp_time), "bubble": (pp - 1) / (m + pp - 1),
            "tp_bytes": max(tp_bytes), "pp_bytes": 2 * m * act if pp > 1 else 0.0,
            "dp_bytes": 2 * (dp - 1) / dp * grads if dp > 1 else 0.0,
            "state_bytes": state, "activation_bytes": activations,
            "memory_bytes": state + activations,
            "tp_crosses_hosts": tp > per_host}


def rank(shape: GPTShape, world: int, hw: Hardware, capacity: float | None = None,
         **kw) -> list[dict]:
    """Every mesh of `world` ranks, fastest predicted step first; with `capacity` (bytes of
    a device's memory) the meshes that do not fit come after every one that does."""
    m = kw.get("microbatches", 1)
    with_cp = kw.pop("with_cp", False)
    rows = [predict_mesh(shape, *mesh[:3], hw, **kw,
                         **({"cp": mesh[3]} if with_cp else {}))
            for mesh in meshes(world, shape, m, with_cp)]
    if not rows:
        raise MicroDDPError(f"no mesh of {world} ranks fits the GPT (heads {shape.n_head}, "
                            f"blocks {shape.n_layer}, batch {shape.batch})")
    for r in rows:
        r["fits"] = capacity is None or r["memory_bytes"] <= capacity
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def table(rows: list[dict]) -> str:
    """The rows as a text table: mesh, step time, bubble, bytes sent per axis, memory."""
    def mb(b: float) -> str:
        return f"{b / 2**20:9.2f}"
    cp = any(r.get("cp", 1) > 1 for r in rows)
    lines = ["  dp x pp x tp" + (" x cp" if cp else "")
             + "     step ms  bubble   TP MiB   PP MiB   DP MiB  memory MiB"
             + ("   CP ring MiB  exposed ms   CP grad MiB" if cp else ""),
             "  ------------" + ("-----" if cp else "")
             + "  ---------  ------  -------  -------  -------  ----------"
             + ("  ------------  ----------  ------------" if cp else "")]
    for r in rows:
        mesh = f"{r['dp']:>3} x{r['pp']:>3} x{r['tp']:>3}" + (f" x{r['cp']:>3}" if cp else "") \
            + ("*" if r["tp_crosses_hosts"] else " ")
        lines.append(f"  {mesh} {1e3 * r['step_s']:10.2f}  {r['bubble']:6.2f} {mb(r['tp_bytes'])}"
                     f"{mb(r['pp_bytes'])}{mb(r['dp_bytes'])}  {mb(r['memory_bytes'])}"
                     + (f"     {mb(r['cp_ring_bytes'])}  {1e3 * r['cp_exposed_s']:10.3f}"
                        f"     {mb(r['cp_grad_bytes'])}" if cp else "")
                     + ("" if r.get("fits", True) else "  does not fit"))
    if any(r["tp_crosses_hosts"] for r in rows):
        lines.append("  * TP group spans hosts: its all-reduces, every block, cross the slow link")
    return "\n".join(lines)
