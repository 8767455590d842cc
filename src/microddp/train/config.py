"""The settings of one training run, and the checks that turn bad input into one clear error."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from ..dp.engine_names import ENGINES
from ..errors import MicroDDPError
from ..flags import at_least, positive

if TYPE_CHECKING:
    from ..ps import PSConfig

# torch, the data sets and the parameter server's settings are imported where a check needs
# them, not above: `microddp train --help` builds this parser and must not wait for torch.

OPTIMIZERS = ("sgd", "adam")
# How the job spreads the model over ranks; each name has its procedure in train/strategies/,
# but async, which is its own job (train/async_job.py): rank 0 a parameter server (microddp.ps),
# the others its workers, under the staleness bound --staleness.
STRATEGIES = ("dp", "pp", "dp-pp", "zero1", "zero2", "zero3", "async")
PIPELINES = ("pp", "dp-pp")  # the strategies that cut the model into --pp stages
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
AMP = ("bf16", "fp16")
DEFAULT_LR = {"sgd": 0.05, "adam": 2e-3}
# Settings that change the numbers a checkpoint holds: a resume must keep them.
RESUME_KEYS = ("dataset", "batch_size", "accumulate", "optimizer", "lr", "seed", "amp",
               "hidden", "depth", "strategy")


@dataclass
class TrainConfig:
    """Everything a run depends on; `microddp train --help` documents each field."""

    nproc: int = 2
    epochs: int = 8
    batch_size: int = 64
    lr: float | None = None  # None: DEFAULT_LR of the optimizer
    optimizer: str = "sgd"
    engine: str = "microddp"
    strategy: str = "dp"
    pp: int | None = None  # pipeline stages (pp, dp-pp); None: every rank (pp), 2 (dp-pp)
    schedule: str = "1f1b"
    microbatches: int | None = None  # per pipeline step; None: one per stage
    dataset: str = "digits"
    accumulate: int = 1
    amp: str | None = None
    hidden: int = 128
    depth: int = 2
    checkpoint_dir: str | None = None  # None: <out>/checkpoints
    checkpoint_every: int = 0  # optimizer steps; 0: at the end of every epoch
    keep: int = 3
    resume: bool = False
    seed: int = 0
    out: str | None = None
    max_restarts: int = 0
    max_steps: int = 0  # 0: run all epochs
    log_every: int = 0  # 0: about five progress lines per epoch
    trace: bool = False
    monitor_timeout: float = 60.0  # seconds a collective may stall before the hang report; 0 off
    drift_every: int = 0  # compare replicas every K optimizer steps; 0 off
    plot: bool = True
    strategy: str = "dp"
    straggler: str = ""  # RANK:FACTOR[,RANK:FACTOR]: those ranks compute FACTOR times slower
    staleness: str = "0"  # async: the bound S, a whole number or "inf"
    staleness_lr: bool = False  # async: divide each gradient's step by its staleness
    backup_workers: int = 0  # async, staleness 0: each update takes the first N-b gradients

    @property
    def learning_rate(self) -> float:
        """`--lr`, or the optimizer's default when not given."""
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    @property
    def ckpt_dir(self) -> Path:
        """Where checkpoints go: `--checkpoint-dir`, else `checkpoints/` in the run folder."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        if self.out is None:
            raise MicroDDPError("no run folder: pass --out DIR")
        return Path(self.out) / "checkpoints"

    def resume_settings(self) -> dict:
        """The settings a checkpoint must match to be resumed with this config."""
        return {k: (self.learning_rate if k == "lr" else getattr(self, k)) for k in RESUME_KEYS}

    def to_argv(self) -> list[str]:
        """The command-line arguments that recreate this config (for the launched workers)."""
        argv: list[str] = []
        defaults = TrainConfig()
        for f in fields(self):
            value, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            if value == getattr(defaults, f.name) or f.name in ("nproc", "max_restarts"):
                continue
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        return argv

    def as_dict(self) -> dict:
        """Every setting by name (for the run's metrics.jsonl)."""
        return asdict(self)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The job's flags, defaults from TrainConfig: `microddp train` and `python -m
    microddp.train` (each rank) parse the same ones."""
    d = TrainConfig()
    a = p.add_argument
    a("-n", "--nproc", type=int, default=d.nproc, help=f"local ranks to start (default {d.nproc})")
    a("--epochs", type=int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    a("--batch-size", type=int, default=d.batch_size,
      help=f"global batch per micro-step, split over ranks (default {d.batch_size})")
    a("--lr", type=float, default=None, help="learning rate (default 0.05 sgd, 0.002 adam)")
    a("--optimizer", default=d.optimizer,
      help=f"{' | '.join(OPTIMIZERS)} (default {d.optimizer})")
    a("--engine", default=d.engine,
      help=f"data-parallel engine: {' | '.join(ENGINES)} (torch = PyTorch's DDP; "
           f"default {d.engine})")
    a("--strategy", default=d.strategy,
      help=f"how the model is spread over the ranks: {' | '.join(STRATEGIES)} (dp: a replica "
           "per rank; pp: the layers cut into stages, one per rank; dp-pp: --pp stages, each "
           "replicated nproc/pp times; zero1/2/3: data parallel with the optimizer state, "
           f"gradients, parameters sharded; async: a parameter server (rank 0) and --nproc - 1 "
           f"workers; default {d.strategy})")
    a("--pp", type=int, default=None,
      help="pipeline stages for pp/dp-pp; data-parallel replicas = nproc / pp "
           "(default: nproc for pp, 2 for dp-pp)")
    a("--schedule", default=d.schedule,
      help=f"pipeline schedule: {' | '.join(SCHEDULES)} (default {d.schedule})")
    a("--microbatches", type=int, default=None,
      help="micro-batches a pipeline cuts each replica's batch into "
           "(default: one per stage, two per stage for interleaved)")
    a("--dataset", default=d.dataset,
      help=f"digits (real, bundled) | synthetic (default {d.dataset})")
    a("--accumulate", type=int, default=d.accumulate,
      help=f"micro-steps per optimizer step, with no_sync (default {d.accumulate})")
    a("--amp", default=None,
      help=f"mixed precision: {' | '.join(AMP)} (fp16 needs CUDA; default: off, float32)")
    a("--hidden", type=int, default=d.hidden, help=f"MLP width (default {d.hidden})")
    a("--depth", type=int, default=d.depth, help=f"hidden layers (default {d.depth})")
    a("--out", default=None, help="run folder (default: a new runs/train-DATE-TIME)")
    a("--checkpoint-dir", default=None, help="checkpoint folder (default OUT/checkpoints)")
    a("--checkpoint-every", type=int, default=d.checkpoint_every,
      help="save every N optimizer steps (default 0: after every epoch)")
    a("--keep", type=int, default=d.keep, help=f"checkpoints to keep (default {d.keep})")
    a("--resume", action="store_true", help="continue from the newest checkpoint in the folder")
    a("--max-restarts", type=int, default=d.max_restarts,
      help="restart all ranks up to K times if one dies; they resume from the last checkpoint "
           f"(default {d.max_restarts})")
    a("--max-steps", type=int, default=d.max_steps,
      help="stop after N optimizer steps (default 0: all)")
    a("--seed", type=int, default=d.seed,
      help=f"seed of the weights and the shuffling (default {d.seed})")
    a("--log-every", type=int, default=d.log_every,
      help="steps between progress lines (default 0: about five per epoch)")
    a("--trace", action="store_true", help="record a timeline of every step (Chrome trace and summary)")
    a("--monitor-timeout", type=float, default=d.monitor_timeout,
      help="seconds a collective may stall before every rank reports where it is "
           f"(default {d.monitor_timeout:g}; 0 turns the hang monitor off)")
    a("--drift-every", type=int, default=d.drift_every,
      help="every K steps check that all replicas hold the same parameters (default 0: off)")
    a("--no-plot", dest="plot", action="store_false", help="skip curves.png")
    a("--straggler", default=d.straggler, metavar="RANK:FACTOR",
      help="make RANK compute FACTOR times slower (several: 1:2,3:4), to measure what a "
           "straggler costs (default: none)")
    a("--staleness", default=d.staleness, metavar="S",
      help="async: no gradient is applied more than S updates late; 0 is synchronous, inf "
           f"fully asynchronous (default {d.staleness})")
    a("--staleness-lr", action="store_true",
      help="async: divide each gradient's step by its staleness")
    a("--backup-workers", type=int, default=d.backup_workers, metavar="B",
      help="async with --staleness 0: each update uses the first N-B gradients to arrive "
           f"(default {d.backup_workers})")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config from parsed flags, ignoring flags that are not settings."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _choice(value, allowed: tuple, what: str) -> None:
    if value not in allowed:
        raise MicroDDPError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


def max_sensible_nproc() -> int:
    """One rank per GPU; on CPU, beyond a few ranks per core they only wait for each other."""
    import torch

    if torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return max(1, 4 * (os.cpu_count() or 1))


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise MicroDDPError naming the first bad setting and how to fix it."""
    import torch

    from ..data import DATASETS

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
    _check_size(cfg)
    n = cfg.nproc if world_size is None else world_size
    if world_size is None:
        limit = max_sensible_nproc()
        if not 1 <= n <= limit:
            where = "one per GPU" if torch.cuda.is_available() else "4 per CPU core"
            raise MicroDDPError(f"--nproc must be between 1 and {limit} here ({where}), got {n}")
    _check_strategy(cfg, n)
    if cfg.strategy == "async":
        _check_async(cfg, n)
    else:
        _check_sync(cfg, n)
    if cfg.drift_every and cfg.strategy not in ("dp", "zero1", "zero2"):
        raise MicroDDPError(f"--drift-every compares whole replicas of the model, which "
                            f"--strategy {cfg.strategy} does not keep on every rank; drop it")
    replicas = n // stages(cfg, n)
    if cfg.strategy != "async" and cfg.batch_size % replicas:
        what = (f"{n} ranks" if replicas == n else
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
    widest_input = 64  # digits' 8x8 pixels; the synthetic set is narrower
    params = widest_input * cfg.hidden + max(cfg.depth - 1, 0) * cfg.hidden ** 2 \
        + cfg.hidden * 10 if cfg.depth else widest_input * 10
    need = 4 * params * 2  # float32 parameters and their gradients, before any optimizer
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): let torch say it
        return
    if need > have:
        raise MicroDDPError(f"--hidden {cfg.hidden} with --depth {cfg.depth} is a model of "
                            f"{params:.3g} parameters, {need / 2**30:.3g} GiB with its gradients, "
                            f"more than this host's {have / 2**30:.3g} GiB; use a smaller --hidden")


def stages(cfg: TrainConfig, world_size: int) -> int:
    """Pipeline ranks per replica: --pp, or its default for the strategy (1: no pipeline)."""
    if cfg.strategy not in PIPELINES:
        return 1
    return cfg.pp or (world_size if cfg.strategy == "pp" else 2)


def microbatches(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per pipeline step: --microbatches, else enough to fill the pipeline."""
    return cfg.microbatches or stages(cfg, world_size) * (2 if cfg.schedule == "interleaved"
                                                          else 1)


def _check_strategy(cfg: TrainConfig, n: int) -> None:
    """The settings a strategy needs, checked before any rank starts."""
    pipeline = cfg.strategy in PIPELINES
    if not pipeline:
        for flag, value, default in (("--pp", cfg.pp, None),
                                     ("--microbatches", cfg.microbatches, None),
                                     ("--schedule", cfg.schedule, "1f1b")):
            if value != default:
                raise MicroDDPError(f"{flag} {value} cuts a pipeline, which --strategy "
                                    f"{cfg.strategy} has none of; use --strategy pp or dp-pp")
        if cfg.strategy.startswith("zero") and cfg.engine != TrainConfig.engine:
            raise MicroDDPError(f"--engine {cfg.engine} chooses a data-parallel engine, which "
                                f"--strategy {cfg.strategy} replaces with ZeRO's own; drop --engine")
        if cfg.strategy.startswith("zero") and cfg.amp == "fp16":
            raise MicroDDPError("--amp fp16 needs a gradient scaler over the whole gradient, "
                                f"which --strategy {cfg.strategy} shards; use --amp bf16")
        return
    for flag, value in (("--pp", cfg.pp), ("--microbatches", cfg.microbatches)):
        if value is not None and value < 1:
            raise MicroDDPError(f"{flag} must be at least 1, got {value}")
    p = stages(cfg, n)
    if n % p:
        raise MicroDDPError(f"--pp {p} stages do not divide --nproc {n} ranks into whole "
                            f"replicas; use a --pp that divides {n}")
    if cfg.strategy == "pp" and p != n:
        raise MicroDDPError(f"--strategy pp puts one stage on every rank, so --pp is {n} "
                            f"(--nproc), not {p}; use --strategy dp-pp for replicated stages")
    virtual = 2 if cfg.schedule == "interleaved" else 1
    if p * virtual > cfg.depth:
        raise MicroDDPError(f"--pp {p}" + (" with the interleaved schedule (2 stages per "
                            "rank)" if virtual > 1 else "") + f" needs {p * virtual} stages, "
                            f"more than the model's {cfg.depth} layers (--depth); use "
                            f"--depth {p * virtual} or more, or fewer stages")
    if cfg.engine != TrainConfig.engine:
        raise MicroDDPError(f"--engine {cfg.engine}: the pipeline strategies replicate each "
                            "stage with microddp's DDP; drop --engine")
    if cfg.amp is not None:
        raise MicroDDPError(f"--amp {cfg.amp} is not supported with --strategy {cfg.strategy} "
                            "(stages exchange float32 activations); drop --amp")
    per_replica = cfg.batch_size // max(1, n // p)
    m = microbatches(cfg, n)
    if per_replica and m > per_replica:
        raise MicroDDPError(f"--microbatches {m} is more than the {per_replica} samples each "
                            f"pipeline gets per step (--batch-size {cfg.batch_size} over "
                            f"{n // p} replicas); use at most {per_replica}")


def ps_config(cfg: TrainConfig, steps: int) -> PSConfig:
    """The parameter-server settings of an async run of `steps` global batches."""
    from ..ps import PSConfig, parse_staleness, parse_straggler

    return PSConfig(steps=steps, lr=cfg.learning_rate, staleness=parse_staleness(cfg.staleness),
                    backup_workers=cfg.backup_workers, staleness_lr=cfg.staleness_lr,
                    stragglers=parse_straggler(cfg.straggler))


def _check_async(cfg: TrainConfig, n: int) -> None:
    if n < 2:
        raise MicroDDPError(f"--strategy async needs --nproc of at least 2: a parameter server "
                            f"(rank 0) and at least one worker, got {n}")
    for flag, used in (("--accumulate", cfg.accumulate != 1), ("--amp", cfg.amp is not None),
                       ("--drift-every", cfg.drift_every != 0)):
        if used:
            raise MicroDDPError(f"{flag} is for the data-parallel strategies; --strategy async "
                                f"does not support it: drop {flag}")
    if cfg.batch_size < n - 1:
        raise MicroDDPError(f"--batch-size {cfg.batch_size} is the global batch, shared by "
                            f"{n - 1} workers; use at least {n - 1}")
    ps_config(cfg, steps=1).check(n)  # staleness, backup workers, straggler ranks


def _check_sync(cfg: TrainConfig, n: int) -> None:
    from ..ps import parse_staleness, parse_straggler

    for rank, factor in parse_straggler(cfg.straggler).items():
        if not 0 <= rank < n or not factor >= 1:
            raise MicroDDPError(f"--straggler {rank}:{factor:g}: the rank must be one of 0.."
                                f"{n - 1} and the factor >= 1 (how many times slower)")
    if cfg.staleness != "0" or cfg.staleness_lr or cfg.backup_workers:
        parse_staleness(cfg.staleness)
        raise MicroDDPError("--staleness, --staleness-lr and --backup-workers belong to a "
                            "parameter server: add --strategy async")


def check_folder(path: str | Path, flag: str) -> None:
    """Create `path` if needed and prove it is writable, or say which flag to change."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise MicroDDPError(f"{flag} {p} is a file, not a folder; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise MicroDDPError(f"{flag} {p} is not writable ({e.strerror}); "
                            "choose a folder you can write to") from None
