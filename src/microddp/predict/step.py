"""Predict DDP step time, communication and scaling efficiency, from one GPU to thousands.

An alpha-beta model: sending n bytes over a link costs alpha + n x beta, with alpha the latency
of a message and beta = 1 / bandwidth the seconds per byte (chapter 4's notation). Compute is
the training FLOPs per sample times the samples per step (--batch), at the device's sustained
rate; a transformer costs about 6 x parameters FLOPs per token (2 forward, 4 backward). A preset
says how many tokens its sample holds; with --params alone a sample is ONE token, so give
--tokens (the sequence length) or --flops-per-sample for a language model. DDP adds three
passes over the gradients in memory (into the buckets, average, back out). Buckets of
gradients are all-reduced one after another on one link, each as soon as backward has produced
it; whatever is still running when backward ends is exposed and lengthens the step.

CPU ranks add a second limit. Their collectives are CPU work too (gloo copies every byte through
the kernel), and ranks beyond the host's cores time-share them: then a step takes at least all
ranks' CPU work divided by the cores. Waiting is not work: while one rank waits for a message,
another computes. So that bound counts only the measured CPU share of communication (`comm_cpu`),
and the step is whichever is longer, the chain of one rank's steps or the host's CPU work.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import outputs
from ..collectives.cost import CostModel
from ..errors import MicroDDPError


@dataclass(frozen=True)
class Hardware:
    """A device and the link between devices. flops: sustained FLOP/s (not the peak)."""

    flops: float
    bandwidth: float  # bytes/s each way per device, as seen by all-reduce (NCCL's "bus bw")
    latency: float  # seconds per message (alpha)
    note: str = ""
    cores: int = 0  # CPU ranks: cores of the host; ranks beyond it time-share them (0: GPUs)
    memory: float = 0.0  # device memory bytes/s, for DDP's bucket copies (0: leave them out)
    comm_cpu: float = 1.0  # CPU ranks: CPU-seconds a rank burns per second of all-reduce
    # CPU ranks: FLOP/s of one rank running alone with every core's threads (0: unknown, then
    # taken as `flops`). Small matrices do not split well over threads, so one process rarely
    # reaches the rate of a rank per core.
    rank_flops: float = 0.0
    # The all-reduce latency and bandwidth were measured on ("shm" on one host, where
    # microddp.comms takes shared memory); predict uses it unless told another.
    algorithm: str = ""


# Sustained rates assume ~40% of the bf16 dense peak, a typical large-model training figure.
HARDWARE = {
    "a100-nvlink": Hardware(125e12, 230e9, 10e-6, "A100 SXM, 8 per node on NVLink",
                            memory=1.5e12),
    "a100-ib": Hardware(125e12, 25e9, 20e-6, "A100 across nodes, 200 Gb/s InfiniBand per GPU",
                        memory=1.5e12),
    "h100-nvlink": Hardware(400e12, 360e9, 10e-6, "H100 SXM, 8 per node on NVLink 4",
                            memory=3e12),
    "h100-ib": Hardware(400e12, 50e9, 20e-6, "H100 across nodes, 400 Gb/s InfiniBand per GPU",
                        memory=3e12),
    "rtx4090-pcie": Hardware(60e12, 12e9, 15e-6, "RTX 4090s in one box, PCIe 4, no NVLink",
                             memory=0.9e12),
    "10gbe": Hardware(60e12, 1.1e9, 50e-6, "one GPU per host, plain 10 Gb Ethernet",
                      memory=0.9e12),
    "cpu-loopback": Hardware(50e9, 1e9, 50e-6, "CPU ranks on one 8-core host, gloo over "
                             "loopback", cores=8, memory=40e9, comm_cpu=0.7),
}


@dataclass(frozen=True)
class Model:
    """A model's size and cost for the predictor: parameters and training FLOPs per sample."""
    params: float
    flops_per_sample: float  # training FLOPs per sample (forward + backward)
    note: str = ""


def _llm(params: float, seq: int, note: str) -> Model:
    return Model(params, 6 * params * seq, note)


MODELS = {
    "resnet50": Model(25.6e6, 3 * 4.1e9, "ResNet-50, 224x224 images"),
    "bert-large": _llm(340e6, 512, "BERT-Large, 512 tokens per sample"),
    "gpt2": _llm(124e6, 1024, "GPT-2 small, 1024 tokens per sample"),
    "gpt2-xl": _llm(1.5e9, 1024, "GPT-2 XL, 1024 tokens per sample"),
    "llama-7b": _llm(6.7e9, 4096, "a 7B decoder, 4096 tokens per sample"),
}
ALGORITHMS = ("ring", "tree", "naive", "shm")  # shm: through shared memory, ranks of one host


def fullmlp(dim: int, depth: int, n_classes: int = 2) -> Model:
    """microddp's FullMLP: every weight used once per sample, so 6 FLOPs per weight."""
    params = depth * (dim * dim + dim) + dim * n_classes + n_classes
    return Model(params, 6.0 * params, f"FullMLP({dim}, depth {depth})")


def allreduce_time(nbytes: float, world: int, hw: Hardware, algorithm: str = "ring") -> float:
    """Seconds to all-reduce nbytes over `world` ranks: the collectives' own cost model, so
    the prediction describes the algorithms microddp actually runs."""
    if algorithm not in ALGORITHMS:
        raise MicroDDPError(f"unknown algorithm {algorithm!r}; choose one of "
                            f"{', '.join(ALGORITHMS)}")
    model = CostModel(alpha=hw.latency, beta=1.0 / hw.bandwidth)
    return model.predict(f"{algorithm}_all_reduce", nbytes, world)  # shm: shm_all_reduce


def across_hosts(nbytes: float, hosts: int, local: int, intra: Hardware,
                 inter: Hardware) -> dict[str, float]:
    """Seconds to all-reduce nbytes over `hosts` hosts of `local` ranks each, flat and
    hierarchical (collectives/hierarchical.py).

    Flat: one ring over all ranks, host by host; each of its 2(p-1) steps waits for the link
    between hosts, which carries n/p bytes a step. Hierarchical: a reduce-scatter and an
    all-gather of n over `local` ranks inside the host, and between them the rails' rings over
    `hosts`: 2(h-1) steps, in each of which a host's `local` rails together send n/h bytes over
    its link."""
    if hosts < 1 or local < 1:
        raise MicroDDPError(f"need at least one host and one rank per host, got {hosts}, {local}")
    inside = CostModel(alpha=intra.latency, beta=1.0 / intra.bandwidth)
    between = CostModel(alpha=inter.latency, beta=1.0 / inter.bandwidth)
    flat = between.predict("ring_all_reduce", nbytes, hosts * local) if hosts > 1 else \
        inside.predict("ring_all_reduce", nbytes, local)
    hier = (inside.predict("ring_reduce_scatter", nbytes, local)
            + between.predict("ring_all_reduce", nbytes, hosts)
            + inside.predict("ring_all_gather", nbytes, local))
    return {"flat_s": flat, "hierarchical_s": hier}


def predict(model: Model, hw: Hardware, world: int, batch: float, algorithm: str = "ring",
            bucket_mb: float = 25.0, grad_bytes: int = 4, overlap: bool = True,
            local_ranks: int = 1) -> dict:
    """One step at `world` ranks with `batch` samples per rank; times in seconds.

    `local_ranks` ranks that share one host also share its compute (CPU ranks do): each gets
    1/local_ranks of it, but no more than one rank alone reaches (`rank_flops`), or one core's
    worth once there are more ranks than cores, when the host's CPU bound (`cpu_bound_s`)
    takes over.
    """
    if world < 1 or not 0 < batch < math.inf:
        raise MicroDDPError(f"world size and batch must be positive, got {world} and {batch}")
    if not 0 < bucket_mb < math.inf:
        raise MicroDDPError(f"the bucket size must be a positive number of MB, got {bucket_mb}")
    if local_ranks < 1 or grad_bytes < 1:
        raise MicroDDPError(f"local ranks and bytes per gradient must be at least 1, got "
                            f"{local_ranks} and {grad_bytes}")
    local = local_ranks
    sharing = min(local, hw.cores) if hw.cores else local  # ranks running at once, each its share
    rate = hw.flops / sharing
    if hw.rank_flops:  # fewer ranks than cores: each has more threads, not more of the host
        rate = min(rate, hw.rank_flops)
    compute = model.flops_per_sample * batch / rate
    forward, backward = compute / 3, 2 * compute / 3
    total = model.params * grad_bytes
    k = max(1, math.ceil(total / (bucket_mb * 2**20)))
    per_bucket = allreduce_time(total / k, world, hw, algorithm)
    comm = k * per_bucket
    # Bucket i is full once (i+1)/k of backward is done and then holds the link for per_bucket;
    # the last one ends at max over i of (ready_i + (k-i) * per_bucket), a linear function of
    # i whose maximum lies at i = 0 or i = k-1: no loop over (possibly billions of) buckets.
    link_free = max(forward + backward / k + k * per_bucket, forward + backward + per_bucket)
    hidden_end = forward + backward
    exposed_overlap = max(0.0, link_free - hidden_end) if world > 1 else 0.0
    exposed = exposed_overlap if overlap else comm
    # DDP copies gradients into buckets, averages them and copies them back: 3 passes
    copies = 3 * total / (hw.memory / sharing) if world > 1 and hw.memory else 0.0
    chain = compute + copies + exposed
    cpu_bound = 0.0
    if hw.cores and local > hw.cores:  # time-shared cores: all ranks' CPU work, over the cores
        busy = compute + copies + (hw.comm_cpu * comm if world > 1 else 0.0)
        cpu_bound = local * busy / hw.cores
    step = max(chain, cpu_bound)
    return {"world": world, "batch": batch, "compute_s": compute, "comm_s": comm,
            "copies_s": copies,
            "exposed_no_overlap_s": comm, "exposed_overlap_s": exposed_overlap,
            "chain_s": chain, "cpu_bound_s": cpu_bound,
            "step_s": step, "comm_comp_ratio": comm / compute, "buckets": k,
            "efficiency": compute / step, "samples_per_s": world * batch / step}


def scaling(model: Model, hw: Hardware, worlds: list[int], batch: float, strong: bool = False,
            **kw) -> list[dict]:
    """Rows for each world size. Weak: `batch` per rank. Strong: `batch` is the global batch.

    speedup = throughput(N) / throughput(1 rank); efficiency = speedup / N.
    """
    local = kw.pop("local_ranks", 1)  # ranks sharing a host: never more than the world
    base = predict(model, hw, 1, batch, **kw)["samples_per_s"]
    rows = []
    for n in worlds:
        row = predict(model, hw, n, batch / n if strong else batch, local_ranks=min(local, n),
                      **kw)
        row["speedup"] = row["samples_per_s"] / base
        row["efficiency"] = row["speedup"] / n
        rows.append(row)
    return rows


def verdict(rows: list[dict], threshold: float = 0.5) -> str:
    """Plain words: where does adding ranks stop paying, and why."""
    bad = [r for r in rows if r["world"] > 1 and r["efficiency"] < threshold]
    if not bad:
        last = rows[-1]
        return (f"data parallelism pays up to {last['world']} ranks: efficiency "
                f"{100 * last['efficiency']:.0f}% there (comm/compute {last['comm_comp_ratio']:.2f})")
    r = bad[0]
    why = ("communication outweighs the compute it could hide behind" if
           r["comm_comp_ratio"] > 1 else "each rank's share of the batch is too small to keep it "
           "busy while gradients travel")
    return (f"data parallelism stops paying at {r['world']} ranks: efficiency "
            f"{100 * r['efficiency']:.0f}% < {100 * threshold:.0f}%; comm/compute = "
            f"{r['comm_comp_ratio']:.2f}: {why}. A bigger batch per rank, fewer/larger buckets, "
            "or a faster link moves the limit")


def table(rows: list[dict]) -> str:
    """The predictions as a fixed-width text table, one line per world size."""
    head = (f"{'ranks':>6} {'batch':>7} {'compute':>10} {'comm':>10} {'exp.no-ovl':>10} "
            f"{'exp.ovl':>10} {'step':>10} {'comm/comp':>9} {'speedup':>8} {'eff':>5}")
    out = [head]
    for r in rows:
        ms = [f"{1e3 * r[k]:>10.3f}" for k in ("compute_s", "comm_s", "exposed_no_overlap_s",
                                              "exposed_overlap_s", "step_s")]
        out.append(f"{r['world']:>6} {r['batch']:>7.4g} {' '.join(ms)} {r['comm_comp_ratio']:>9.3f} "
                   f"{r.get('speedup', float('nan')):>8.1f} {100 * r['efficiency']:>4.0f}%")
    return "\n".join(out)


def save_calibration(hw: Hardware, path: str, pipeline: dict | None = None) -> None:
    """Write measured hardware figures as JSON, for `microddp predict --hardware calibrated`;
    `pipeline`: the measured pipeline costs (`pipeline_costs.PipelineCosts` as a dict), kept
    under their own key."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    saved = asdict(hw) | ({"pipeline": pipeline} if pipeline is not None else {})
    outputs.write_text(path, json.dumps(saved))


def load_calibration(path: str) -> tuple[Hardware, dict | None]:
    """The figures `save_calibration` wrote: the hardware, and the pipeline costs if any."""
    try:
        saved = json.loads(Path(path).read_text())
        pipeline = saved.pop("pipeline", None)
        hw = Hardware(**saved)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise MicroDDPError(f"{path} is not a calibration this microddp can read ({e}); run "
                            "`microddp predict --calibrate` to write a new one") from None
    bad = [f for f in ("flops", "bandwidth", "latency") if not _positive(getattr(hw, f))]
    if bad:
        raise MicroDDPError(f"{path} is not a calibration this microddp can read ({bad[0]} is "
                            f"{getattr(hw, bad[0])!r}); run `microddp predict --calibrate` to "
                            "write a new one")
    return hw, pipeline


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
