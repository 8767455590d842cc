"""The pieces a run is made of: model, data-parallel engine, optimizer, mixed precision
(the strategies in train/strategies/ put them together)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import MicroDDPError
from ..model import FullMLP
from ..world.world import World, distributed
from .config import TrainConfig


class Local(nn.Module):
    """A world of one process: nothing to synchronise, but the same face as DDP."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        """Run the module as it is: a world of one has nothing to average."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to hold back in a world of one; DDP's interface, so the loop needs no special
        case."""
        yield


def build_model(cfg: TrainConfig, in_features: int, n_classes: int,
                device: torch.device) -> nn.Module:
    """The same initial weights on every rank and in every run with this --seed."""
    torch.manual_seed(cfg.seed)
    return FullMLP(cfg.hidden, depth=cfg.depth, n_classes=n_classes,
                   in_features=in_features).to(device)


def wrap(module: nn.Module, engine: str, world: World) -> nn.Module:
    """Put `module` under the chosen data-parallel engine (all behave like torch's DDP)."""
    if not distributed():
        return Local(module)
    from ..dp import wrap as dp_wrap

    kwargs = {"device_ids": [world.device.index]} if world.device.type == "cuda" else {}
    return dp_wrap(module, engine, **kwargs)


# --optimizer's table: the class and its options, besides the run's learning rate (every
# strategy builds from it: build_optimizer, or ZeRO's sharded optimizer from the class).
OPTIMIZER_CLASSES = {"sgd": (torch.optim.SGD, {"momentum": 0.9}), "adam": (torch.optim.Adam, {})}


def optimizer_class(cfg: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class `--optimizer` names and its options (SGD with momentum 0.9, or Adam)."""
    if cfg.optimizer not in OPTIMIZER_CLASSES:
        raise MicroDDPError(f"unknown optimizer {cfg.optimizer!r}; choose sgd or adam")
    return OPTIMIZER_CLASSES[cfg.optimizer]


def build_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    """The optimizer `--optimizer` names at the run's learning rate."""
    cls, options = optimizer_class(cfg)
    return cls(params, lr=cfg.learning_rate, **options)


class Precision:
    """Autocast for the forward pass and, for float16, a gradient scaler for the backward.

    bfloat16 has float32's exponent range, so its gradients do not underflow and need no
    scaler; float16 does, and its autocast and scaler are a CUDA feature.
    """

    def __init__(self, amp: str | None, device: torch.device) -> None:
        if amp == "fp16" and device.type != "cuda":
            raise MicroDDPError("--amp fp16 needs a CUDA GPU (float16 autocast with a gradient "
                                "scaler); on CPU use --amp bf16")
        self.amp, self.device = amp, device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
        self.scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward runs in: autocast to the chosen dtype, or nothing for float32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from `loss`, scaled first with fp16 so small gradients do not flush to zero."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer; with fp16, unscaled and skipped when the gradients overflowed."""
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step if the scaled gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict | None:
        """The gradient scaler's state for a checkpoint (None without one)."""
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the gradient scaler's state from a checkpoint."""
        if self.scaler and state:
            self.scaler.load_state_dict(state)


Hook = Callable[[int], None]
