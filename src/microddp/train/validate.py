"""The checks that turn bad input into one clear error before any rank starts: the settings
every run shares, here, then the named strategy's own (`check` in its file of strategies/,
found through the one table, strategies/registry.py)."""

from __future__ import annotations

import importlib.util
import math
import os

from ..dp.engine_names import ENGINES
from ..errors import MicroDDPError
from ..flags import at_least, positive
from . import strategies
from .config import (
    AMP,
    MODELS,
    OPTIMIZERS,
    SCHEDULES,
    STRATEGIES,
    TrainConfig,
    max_sensible_nproc,
    stages,
)


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise MicroDDPError naming the first bad setting and how to fix it."""
    import torch

    from ..data import DATASETS

    _choice(cfg.model, MODELS, "model")
    _choice(cfg.dataset, DATASETS, "dataset")
    if cfg.dataset == "digits" and importlib.util.find_spec("sklearn") is None:
        raise MicroDDPError("the digits data set ships with scikit-learn, which is not "
                            "installed: pip install 'microddp[train]' (or use --dataset synthetic)")
    _choice(cfg.engine, ENGINES, "engine")
    _choice(cfg.optimizer, OPTIMIZERS, "optimizer")
    _choice(cfg.strategy, STRATEGIES, "strategy")
    _choice(cfg.schedule, SCHEDULES, "pipeline schedule")
    if cfg.amp is not None:
        _choice(cfg.amp, AMP, "--amp precision")
        if cfg.amp == "fp16" and not torch.cuda.is_available():
            raise MicroDDPError("--amp fp16 needs a CUDA GPU (float16 autocast with a gradient "
                                "scaler); on CPU use --amp bf16")
    for value, low, name in ((cfg.epochs, 1, "epochs"), (cfg.batch_size, 1, "batch_size"),
                             (cfg.accumulate, 1, "accumulate"), (cfg.hidden, 1, "hidden"),
                             (cfg.depth, 0, "depth"), (cfg.keep, 1, "keep"),
                             (cfg.checkpoint_every, 0, "checkpoint_every"),
                             (cfg.max_restarts, 0, "max_restarts"),
                             (cfg.max_steps, 0, "max_steps"), (cfg.log_every, 0, "log_every"),
                             (cfg.seed, 0, "seed"), (cfg.drift_every, 0, "drift_every")):
        at_least(low, **{name: value})
    # `not x > 0` lets inf through and comparisons let nan through: both train to NaN weights
    # or never time out, so a float setting must also be finite.
    positive("lr", cfg.lr)
    if not (math.isfinite(cfg.monitor_timeout) and cfg.monitor_timeout >= 0):
        raise MicroDDPError(f"--monitor-timeout must be a finite number of seconds, at least 0 "
                            f"(0 turns the hang monitor off), got {cfg.monitor_timeout}")
    if 0 < cfg.monitor_timeout < MIN_MONITOR_TIMEOUT_S:  # healthy ranks are that far apart
        raise MicroDDPError(f"--monitor-timeout {cfg.monitor_timeout:g} s would report healthy "
                            f"ranks as hung (they drift apart by more within a step); use at "
                            f"least {MIN_MONITOR_TIMEOUT_S:g} s, or 0 to turn the monitor off")
    if cfg.seed > MAX_SEED:  # NumPy's generators take 32 bits, torch's 64
        raise MicroDDPError(f"--seed must be at most {MAX_SEED} (2**32 - 1), got {cfg.seed}")
    at_least(1, tp=cfg.tp, cp=cfg.cp, heads=cfg.heads)
    if cfg.replacements and not cfg.elastic:
        raise MicroDDPError("--replacements needs --elastic (only an elastic job takes a new "
                            "rank in); add --elastic or drop --replacements")
    if cfg.elastic:
        from .elastic_check import check as check_elastic

        check_elastic(cfg, world_size)
    _check_size(cfg)
    n = cfg.nproc if world_size is None else world_size
    _check_model(cfg, n)
    if world_size is None:
        limit = max_sensible_nproc()
        if not 1 <= n <= limit:
            where = "one per GPU" if torch.cuda.is_available() else "4 per CPU core"
            raise MicroDDPError(f"--nproc must be between 1 and {limit} here ({where}), got {n}")
    entry = strategies.entry(cfg.strategy)
    if not entry.pipeline and not (cfg.model == "gpt" and cfg.strategy in MESH_STRATEGIES):
        for flag, value, default in (("--pp", cfg.pp, None),
                                     ("--microbatches", cfg.microbatches, None),
                                     ("--schedule", cfg.schedule, "1f1b")):
            if value != default:
                raise MicroDDPError(f"{flag} {value} cuts a pipeline, which --strategy "
                                    f"{cfg.strategy} has none of; use --strategy pp or dp-pp"
                                    + (" (or dp: the GPT's mesh)" if cfg.model == "gpt" else ""))
    strategies.check(cfg, n)
    if not entry.own_loop:
        _check_synchronous(cfg, n)
    if cfg.drift_every and not entry.replicas:
        raise MicroDDPError(f"--drift-every compares whole replicas of the model, which "
                            f"--strategy {cfg.strategy} does not keep on every rank; drop it")
    replicas = n // (stages(cfg, n) * cfg.tp * cfg.cp)
    if not entry.own_loop and cfg.batch_size % replicas:
        what = (f"{n} ranks" if replicas == n else
                f"{replicas} replicas ({n} ranks / (--cp {cfg.cp} x --tp {cfg.tp}))"
                if cfg.cp > 1 else
                f"{replicas} replicas ({n} ranks / (--tp {cfg.tp} x {stages(cfg, n)} stages))"
                if cfg.tp > 1 else
                f"{replicas} replicas ({n} ranks / {stages(cfg, n)} stages)")
        raise MicroDDPError(f"--batch-size {cfg.batch_size} is the global batch and must split "
                            f"evenly over {what}; use a multiple of {replicas}")
    if cfg.resume and not (cfg.out or cfg.checkpoint_dir):
        raise MicroDDPError("--resume needs the run to continue: pass its --out DIR "
                            "(or --checkpoint-dir)")


MIN_MONITOR_TIMEOUT_S = 1.0
MAX_SEED = 2**32 - 1


def _check_size(cfg: TrainConfig) -> None:
    """A model that cannot fit in this host's memory is refused before a rank allocates it
    (--hidden 10000000 asked the allocator for 400 TB, and every rank died of it)."""
    if cfg.model == "gpt":  # --depth blocks of attention (4 d^2) and MLP (8 d^2), embeddings
        params = cfg.depth * 12 * cfg.hidden ** 2 + (256 + 32) * cfg.hidden
        _refuse_size(cfg, params)
        return
    widest_input = 64  # digits' 8x8 pixels; the synthetic set is narrower
    params = widest_input * cfg.hidden + max(cfg.depth - 1, 0) * cfg.hidden ** 2 \
        + cfg.hidden * 10 if cfg.depth else widest_input * 10
    _refuse_size(cfg, params)


def _refuse_size(cfg: TrainConfig, params: int) -> None:
    need = 4 * params * 2  # float32 parameters and their gradients, before any optimizer
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): let torch say it
        return
    if need > have:
        raise MicroDDPError(f"--hidden {cfg.hidden} with --depth {cfg.depth} is a model of "
                            f"{params:.3g} parameters, {need / 2**30:.3g} GiB with its gradients, "
                            f"more than this host's {have / 2**30:.3g} GiB; use a smaller --hidden")


GPT_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "pp", "dp-pp")
MESH_STRATEGIES = ("dp", "zero1", "zero2")  # --pp with the GPT: its mesh (dp, ZeRO over dp)


def _check_model(cfg: TrainConfig, n: int) -> None:
    """--model, --dataset and --tp go together: the MLP reads digits or synthetic data and has
    no layer to split; the GPT reads text, under dp or ZeRO, or on a dp x pp x tp mesh (--tp,
    --pp; strategies/mesh3d.py checks the mesh)."""
    if cfg.cp > 1 and (cfg.model != "gpt" or cfg.strategy != "dp"):
        raise MicroDDPError(f"--cp {cfg.cp} splits a transformer's sequence: it runs with "
                            f"--model gpt under --strategy dp, not --model {cfg.model} "
                            f"--strategy {cfg.strategy}")
    if cfg.model == "mlp":
        if cfg.tp != 1:
            raise MicroDDPError(f"--tp {cfg.tp} splits a transformer's attention heads and MLP, "
                                "which --model mlp has none of; add --model gpt")
        if cfg.dataset == "text":
            raise MicroDDPError("--dataset text is bytes for a language model: add --model gpt")
        return
    if cfg.dataset != "text":
        raise MicroDDPError(f"--model gpt reads --dataset text (bytes of Python's source), "
                            f"not {cfg.dataset}; drop --dataset")
    if cfg.strategy not in GPT_STRATEGIES:
        raise MicroDDPError(f"--model gpt trains with --strategy {' | '.join(GPT_STRATEGIES)}; "
                            f"{cfg.strategy} is not wired to the GPT yet (the parameter server "
                            "takes the MLP)")
    from ..gpt import GPTConfig
    from ..tp.gpt import check_split

    GPTConfig(n_head=cfg.heads, d_model=cfg.hidden, n_layer=max(cfg.depth, 1))
    if cfg.depth < 1:
        raise MicroDDPError("--model gpt needs --depth of at least 1 block")
    if cfg.tp == 1 and cfg.pp in (None, 1) or cfg.cp > 1 and (cfg.pp or 1) > 1:
        return  # nothing to split, or --cp with --pp: strategies/context.py refuses it
    if cfg.tp > 1:
        if n % cfg.tp:
            raise MicroDDPError(f"--tp {cfg.tp} must divide --nproc {n}: each replica is --tp "
                                f"ranks and replicas = nproc / tp")
        check_split(GPTConfig(n_head=cfg.heads, d_model=cfg.hidden), cfg.tp)
    if cfg.strategy == "zero3":
        raise MicroDDPError(f"--tp {cfg.tp} / --pp runs under --strategy dp, zero1, zero2 (or "
                            f"pp, dp-pp); ZeRO-3 over the data-parallel ranks of a mesh is not "
                            f"built yet")


def _choice(value, allowed: tuple, what: str) -> None:
    if value not in allowed:
        raise MicroDDPError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


def _check_synchronous(cfg: TrainConfig, n: int) -> None:
    """What every strategy of the synchronous loop refuses: a straggler rank outside the
    world, and the parameter server's settings."""
    from ..ps import parse_staleness, parse_straggler

    for rank, factor in parse_straggler(cfg.straggler).items():
        if not 0 <= rank < n or not factor >= 1:
            raise MicroDDPError(f"--straggler {rank}:{factor:g}: the rank must be one of 0.."
                                f"{n - 1} and the factor >= 1 (how many times slower)")
    if cfg.staleness != "0" or cfg.staleness_lr or cfg.backup_workers or cfg.servers != 1:
        parse_staleness(cfg.staleness)
        raise MicroDDPError("--staleness, --staleness-lr, --backup-workers and --servers belong "
                            "to a parameter server: add --strategy async")
