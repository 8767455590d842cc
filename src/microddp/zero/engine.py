"""`Zero`: data parallelism with sharded model state, stages 1, 2 and 3 of the ZeRO paper.

    model = zero.Zero(mdp.FullMLP(128, 16), torch.optim.Adam, stage=2, lr=1e-3)
    loss_fn(model(x), y).backward()
    model.step()
    model.zero_grad()

Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.
Every stage computes what plain data parallelism computes (averaged gradients, one optimizer
step on every element), so the trained parameters are the same to float rounding.

Traced (`--trace`, microddp.spans), a step shows its phases: each bucket's gradient reduce
during backward and the wait for them (grads.py), the shard's optimizer step ("shard step"),
each bucket's broadcast of the updated elements ("all-gather bucket k") and the wait for them,
and in stage 3 each layer's gather, prefetch and free (params.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .. import comms, spans
from ..dp.buckets import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MiB, check_bucket_cap
from ..dp.sync import verify_same_model
from ..errors import MicroDDPError
from ..monitor.memory import measure
from .comm import Sent, broadcast_shards, trace_when_done
from .flat import flat_views
from .grads import GradReducer
from .params import FREE, ParamSharder
from .plan import build, by_size
from .shards import Shards, trainable_groups

STAGES = (1, 2, 3)


class Zero(nn.Module):
    """Wrap `module` for ZeRO stage `stage`; `optimizer_class(**defaults)` steps this rank's
    shard. `param_groups` are torch's (lists or dicts of the module's parameters, with their
    own options); by default every parameter is in one group.

    Parameters and buffers start as rank 0's, as with DDP. Gradients are averaged over ranks,
    bucket by bucket during backward. `bucket_cap_mb` sizes the buckets of stages 1 and 2 as
    DDP's does: by default 25 MiB after a first bucket of 1 MiB (so communication starts
    early in backward); given, every bucket gets that cap. Stage 3 uses one bucket per module
    (per parameter group within it). In stages 1 and 2 each bucket's parameters become views
    of one flat buffer, this rank's shard a view of its part of it: the optimizer updates
    that part in place, and the other ranks' updated parts are broadcast into the rest.
    """

    def __init__(self, module: nn.Module, optimizer_class: type, stage: int = 1,
                 param_groups: Iterable[Any] | None = None, bucket_cap_mb: float | None = None,
                 **defaults: Any) -> None:
        super().__init__()
        if stage not in STAGES:
            raise MicroDDPError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if not isinstance(optimizer_class, type) or not issubclass(optimizer_class,
                                                                   torch.optim.Optimizer):
            raise MicroDDPError(f"Zero needs a torch.optim.Optimizer class, got "
                                f"{optimizer_class!r}; e.g. Zero(model, torch.optim.Adam, lr=1e-3)")
        if optimizer_class is torch.optim.LBFGS:
            raise MicroDDPError("LBFGS needs the whole gradient at once (a line search over "
                                "all parameters), so it cannot step a shard; use an element-wise "
                                "optimizer such as SGD, Adam or AdamW")
        check_bucket_cap(bucket_cap_mb)
        self.module, self.stage = module, stage
        self.world_size, self.rank = comms.group_size(), comms.group_rank()
        # One rank with another layer size, a frozen parameter, stage, optimizer or bucket
        # size would train on with diverging losses (or abort inside gloo): refuse it here.
        optimizer = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        given_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)  # 25 is 25.0
        verify_same_model(module, wrapper="Zero", settings={
            "stage": stage, "optimizer": optimizer,
            "optimizer options": dict(sorted(defaults.items())), "bucket_cap_mb": given_mb})
        self._sync_initial_state()
        params, groups, options = trainable_groups(module, param_groups)
        if not params:
            raise MicroDDPError("the module has no parameter that requires grad; "
                                "there is nothing to train or shard")
        kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
        if len(kinds) > 1:
            # A bucket is one flat buffer of one dtype on one device: a parameter of another
            # would be converted silently into it (and its view of it would change its dtype).
            raise MicroDDPError(f"Zero shards parameters of one dtype on one device; this module "
                                f"has {' and '.join(kinds)}: cast the module (e.g. "
                                "model.float()) or freeze the odd ones out before wrapping it")
        self.sharded = params
        numels = [p.numel() for p in params]
        if stage == 3:
            units, bucket_params = self._units(module, params, groups)
        else:
            size = params[0].element_size()
            cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
            cap = max(1, int(cap_mb * MiB) // size)
            first = FIRST_BUCKET_BYTES // size if bucket_cap_mb is None else None
            bucket_params = by_size(numels, groups, cap, first)
        self.plan = build(numels, groups, bucket_params, self.world_size)
        # Stages 1 and 2: each bucket's parameters live in one flat buffer, and this rank's
        # shard is a view of its part of it (ZeRO-3's sharder makes its own, emptied between
        # uses, so its shards are copies).
        self.flats = ([flat_views(b, params) for b in self.plan.buckets] if stage < 3 else [])
        self.shards = Shards(self.plan, self.rank, params, options, optimizer_class, defaults,
                             flats=self.flats if stage < 3 else None)
        self.optimizer = self.shards.optimizer
        self.sent = Sent()
        self._in_no_sync = False
        # ZeRO-2/3 keep the averaged gradients in the shards, which only zero_grad() on this
        # wrapper clears: `_stepped` says a step used them and they were not cleared since;
        # `_stale` that a backward then added more to them (see _on_backward, step).
        self._stepped = self._stale = False
        self._memory: dict[str, int] = {}
        self.sharder = None
        on_reduced = None
        if stage == 3:
            self.sharder = ParamSharder(self.plan, params, units, self.shards, self.sent)
            on_reduced = self.sharder.after_reduce
        self.reducer = GradReducer(self.plan, params, self.shards, self.sent, on_reduced,
                                   keep_grads=stage == 1)
        self.reducer.on_start = self._on_backward
        self._hooks = self.reducer.attach_hooks()
        if self.sharder is not None:
            self.reducer.on_end = self.sharder.free_all

    def _sync_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does."""
        for t in [*self.module.parameters(), *self.module.buffers()]:
            comms.broadcast(t.data, src=0)

    @staticmethod
    def _units(module: nn.Module, params: list, groups: list[int]):
        """Stage 3's units: each module owning sharded parameters (with its name in `module`,
        which the trace shows), one bucket per group."""
        index = {id(p): i for i, p in enumerate(params)}
        units, bucket_params = [], []
        for name, sub in module.named_modules():
            own = [index[id(p)] for p in sub.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            ids = []
            for g in dict.fromkeys(groups[i] for i in own):
                ids.append(len(bucket_params))
                bucket_params.append([i for i in own if groups[i] == g])
            units.append((name or type(sub).__name__, sub, ids))
        return units, bucket_params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (the parameter hooks gather what stage 3 needs)."""
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the block ends; the
        backward after it (the last micro-step) averages them all. Stage 3 keeps the
        parameters gathered meanwhile, so only the first micro-step's forward gathers them."""
        before = (self.reducer.sync, self._in_no_sync)
        self.reducer.sync, self._in_no_sync = False, True
        if self.sharder is not None:
            self.sharder.keep = True
        try:
            yield
        finally:
            self.reducer.sync, self._in_no_sync = before
            if self.sharder is not None:
                self.sharder.keep = self._in_no_sync

    def _on_backward(self) -> None:
        """A synchronized backward starts: if the shards still hold gradients a step already
        applied, the loop cleared gradients some other way (model.zero_grad() on the inner
        module, its own optimizer's zero_grad()), which cannot reach the shards."""
        if self.stage > 1 and self._stepped and any(s.grad is not None
                                                    for s in self.shards.params):
            self._stale = True

    def step(self) -> None:
        """Step the shards (their gradients were averaged during backward), and (stages 1
        and 2) broadcast the updated elements into every rank's full parameters."""
        if self._in_no_sync:
            raise MicroDDPError("step() was called inside no_sync(): the gradients are not "
                                "averaged yet; run the last micro-step's forward and backward "
                                "after the block, then call step()")
        if self._stale:
            # Every rank gets here at the same step (the same calls on every rank), so all
            # refuse together and no collective is left waiting.
            raise MicroDDPError(
                f"ZeRO-{self.stage} keeps the averaged gradients in this rank's shards, and "
                "those of the previous step were never cleared: step() would apply the sum of "
                "both; call zero_grad() on the Zero wrapper after each step (the inner "
                "module's zero_grad() or another optimizer's cannot reach the shards)")
        self._memory = self.measure_now()
        with spans.span("shard step", track="optim"):
            self.optimizer.step()
        if self.stage < 3:
            self._gather_params()
        self.sent.end_step()
        self._stepped = True

    def _gather_params(self) -> None:
        """Every rank's updated elements into every rank's flat parameter buffers: all the
        broadcasts start before the first wait, so they travel together."""
        handles = []
        for b, flat in zip(self.plan.buckets, self.flats, strict=True):
            # this rank's elements are in `flat` already: the shard the optimizer stepped is
            # a view of them
            launched = time.perf_counter()
            sent = broadcast_shards(b, flat, self.rank, self.sent)
            trace_when_done(sent, f"all-gather bucket {b.index}", launched, bucket=b.index,
                            bytes=flat.numel() * flat.element_size())
            handles += sent
        t0 = time.perf_counter()
        for handle in handles:
            handle.wait()
        if handles and spans.enabled():
            spans.add_span("wait params", t0, time.perf_counter(), track="comm_wait")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shard gradients and any full gradients still held."""
        self.shards.zero_grad()
        self._stepped = self._stale = False
        self.module.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """The module with its full parameters (stage 3 gathers them, then frees them)."""
        if self.sharder is None:
            yield self.module
            return
        with spans.use(None):  # not a training step's work: kept out of the step timeline
            self.sharder.gather_all()
        # Stay gathered through every forward in the block: a forward that freed its layer
        # would gather it again, a collective the other ranks may not be making (ranks that
        # evaluate different batches).
        keep, self.sharder.keep = self.sharder.keep, True
        try:
            yield self.module
        finally:
            self.sharder.keep = keep
            with spans.use(None):
                self.sharder.free_all()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole module's state_dict, on every rank (copies, so they outlive stage 3's
        freeing)."""
        with self.gathered() as module:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def consolidated_state_dict(self, to_rank: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole module's state_dict on rank `to_rank`, None on the others.

        Stages 1 and 2 hold every parameter already: no communication. Stage 3 gathers one
        unit at a time with tensor all-gathers and frees it again, so no rank but `to_rank`
        ever holds the whole model, and nothing travels through pickle (torch's
        ZeroRedundancyOptimizer.consolidate_state_dict sends every rank's state as objects
        to one rank: the out-of-memory path users hit).
        """
        mine = self.rank == to_rank
        full: dict[int, torch.Tensor] = {}
        if self.sharder is not None:
            with spans.use(None):  # saving is not a training step's work
                for unit in self.sharder.units:
                    was_full = unit.state != FREE
                    self.sharder.ensure_full(unit)
                    if mine:
                        for b in unit.buckets:
                            for i in b.params:
                                full[id(self.sharded[i])] = self.sharded[i].detach().clone()
                    if not was_full:
                        self.sharder._free(unit)
        if not mine:
            return None
        ids = {n: id(p) for n, p in self.module.named_parameters()}
        return {k: full[ids[k]] if ids.get(k) in full else v.detach().clone()
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def refresh_from_shards(self) -> None:
        """The shards were overwritten (a checkpoint loaded): stages 1 and 2 broadcast them
        into every rank's full parameters (stage 3 gathers from the shards at each use)."""
        if self.stage < 3:
            with spans.use(None):  # nor a training step's time
                self._gather_params()
        self.sent.end_step()  # not a training step's traffic

    def measure_now(self) -> dict[str, int]:
        """Bytes of the live tensors of this rank now (see memory.measure)."""
        return measure([*self.module.parameters(), *self.shards.params], self.optimizer)

    def memory(self) -> dict[str, int]:
        """This rank's bytes at the start of the last step() (gradients ready, optimizer
        state from the step before), and the bytes it sent during that step."""
        if not self._memory:
            raise MicroDDPError("memory() is measured at step(): call it after a step")
        return {**self._memory, "sent_per_step": self.sent.last_step}
