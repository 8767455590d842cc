"""The settings of one training run, and the checks that turn bad input into one clear error."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..dp.engine_names import ENGINES
from ..errors import MicroDDPError
from .strategies.registry import PIPELINES, STRATEGIES

# torch, the data sets and the parameter server's settings are imported where a check needs
# them, not above: `microddp train --help` builds this parser and must not wait for torch.

MODELS = ("mlp", "gpt")
OPTIMIZERS = ("sgd", "adam")  # the names; train/build.py maps each to its class (torch)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
AMP = ("bf16", "fp16")
DEFAULT_LR = {"sgd": 0.05, "adam": 2e-3}
# Settings that change the numbers a checkpoint holds: a resume must keep them.
RESUME_KEYS = ("model", "heads", "dataset", "batch_size", "accumulate", "optimizer", "lr", "seed", "amp",
               "hidden", "depth", "strategy")


@dataclass
class TrainConfig:
    """Everything a run depends on; `microddp train --help` documents each field."""

    nproc: int = 2
    model: str = "mlp"  # gpt: microddp.gpt.GPT on --dataset text (implied)
    tp: int = 1  # tensor-parallel ranks per replica (--model gpt); replicas = nproc / tp
    cp: int = 1  # context-parallel ranks per replica (--model gpt): the windows split C ways
    heads: int = 4  # --model gpt: attention heads (d_model is --hidden, layers --depth)
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
    servers: int = 1  # async: ranks 0..servers-1 each serve a shard of the parameters
    elastic: bool = False  # dp: lose ranks and go on in place (train/elastic.py)
    min_ranks: int = 1  # --elastic: below this many ranks the job stops
    elastic_timeout: float = 10.0  # --elastic: seconds a collective may block before it fails
    replacements: int = 0  # --elastic: ranks the launcher may start to replace lost ones

    def __post_init__(self) -> None:
        # The GPT reads text: --model gpt without a --dataset means --dataset text.
        if self.model == "gpt" and self.dataset == "digits":
            self.dataset = "text"

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
            if value == getattr(defaults, f.name) or f.name in ("nproc", "max_restarts", "replacements"):
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
    a("--model", default=d.model,
      help=f"{' | '.join(MODELS)} (mlp: FullMLP on --dataset digits/synthetic; gpt: a small "
           f"GPT on --dataset text, bytes of Python's own source; default {d.model})")
    a("--tp", type=int, default=d.tp,
      help="--model gpt: tensor-parallel ranks per pipeline stage (with --pp: a dp x pp x tp "
           f"mesh, tp innermost); replicas = nproc / (tp x pp) (default {d.tp})")
    a("--cp", type=int, default=d.cp,
      help="--model gpt: context-parallel ranks per replica, each holding 2 of 2 x cp chunks "
           "of every window (ring attention; with --tp: a dp x cp x tp mesh, tp innermost); "
           f"replicas = nproc / (cp x tp) (default {d.cp})")
    a("--heads", type=int, default=d.heads,
      help=f"--model gpt: attention heads; --hidden is the width, --depth the blocks "
           f"(default {d.heads})")
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
      help="pipeline stages for pp/dp-pp, and for --model gpt under dp (a dp x pp x tp mesh); "
           "data-parallel replicas = nproc / (pp x tp) (default: nproc for pp, 2 for dp-pp, "
           "1 for dp)")
    a("--schedule", default=d.schedule,
      help=f"pipeline schedule: {' | '.join(SCHEDULES)} (default {d.schedule})")
    a("--microbatches", type=int, default=None,
      help="micro-batches a pipeline cuts each replica's batch into "
           "(default: one per stage, two per stage for interleaved)")
    a("--dataset", default=d.dataset,
      help=f"digits (real, bundled) | synthetic | text (--model gpt's, implied by it; "
           f"default {d.dataset})")
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
           f"(default {d.monitor_timeout:g}; 0 turns the hang monitor off); with --strategy "
           "async, how long the server waits for a silent worker before dropping it")
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
    a("--servers", type=int, default=d.servers, metavar="S",
      help="async: the parameters sharded over S server ranks (0..S-1), every worker pulling "
           f"from and pushing to each (default {d.servers})")
    add_elastic_arguments(p)


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    """--elastic and its settings (train/elastic.py)."""
    d = TrainConfig()
    p.add_argument("--elastic", action="store_true",
                   help="dp: when a rank dies the others form a new group and go on in "
                        "place, the global batch kept (no restart, nothing read from disk)")
    p.add_argument("--min-ranks", type=int, default=d.min_ranks,
                   help=f"--elastic: stop (with a checkpoint) below this many ranks "
                        f"(default {d.min_ranks})")
    p.add_argument("--elastic-timeout", type=float, default=d.elastic_timeout,
                   help="--elastic: seconds a collective may block before it counts as "
                        f"failed (default {d.elastic_timeout:g})")
    p.add_argument("--replacements", type=int, default=d.replacements,
                   help="--elastic: start up to K new ranks in place of lost ones; each joins at "
                        "a step boundary with the state of a live rank (default 0)")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config from parsed flags, ignoring flags that are not settings."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def max_sensible_nproc() -> int:
    """One rank per GPU; on CPU, beyond a few ranks per core they only wait for each other."""
    import torch

    if torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return max(1, 4 * (os.cpu_count() or 1))


def stages(cfg: TrainConfig, world_size: int) -> int:
    """Pipeline ranks per replica: --pp, or its default for the strategy (1: no pipeline)."""
    if cfg.strategy not in PIPELINES:  # the GPT's mesh takes --pp under dp too
        return (cfg.pp or 1) if cfg.model == "gpt" else 1
    return cfg.pp or (world_size if cfg.strategy == "pp" else 2)


def microbatches(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per pipeline step: --microbatches, else enough to fill the pipeline."""
    return cfg.microbatches or stages(cfg, world_size) * (2 if cfg.schedule == "interleaved"
                                                          else 1)


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
