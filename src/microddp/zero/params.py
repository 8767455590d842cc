"""Parameter sharding (ZeRO-3): a layer's parameters exist in full only while it computes.

Each module that owns parameters is a unit. Its parameters become views of one flat buffer per
bucket whose storage is emptied (resized to zero bytes) between uses, so between steps a rank
holds only its shard. A forward pre-hook gathers the unit's parameters (one broadcast per
rank of its elements, straight into the flat buffer) just before its forward and a forward hook frees them after; a hook on the unit's output gathers them again
just before its backward, and the gradient reducer frees them once their gradients are sent.
Each gather also starts the next unit's gather (in the order the first forward ran them, and
in reverse for backward), so communication overlaps the current unit's compute.

The views never change, only their storage's size, so tensors autograd saved during forward
are the same tensors backward finds, refilled with the same values.

Traced, each gather is a "gather NAME" span on the communication track ("prefetch NAME" when a
neighbour's hook started it ahead of use; NAME: the module's name in the model), a wait for
one still in flight is "wait gather NAME", and each free is "free", the module in its args.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from .. import spans
from .comm import Sent, broadcast_shards, trace_when_done
from .flat import flat_views
from .plan import Bucket, ShardPlan
from .shards import Shards

FREE, GATHERING, FULL = "free", "gathering", "full"


class Unit:
    """One module's sharded parameters: its buckets, their flat buffers, and its state."""

    def __init__(self, index: int, name: str, module: nn.Module, buckets: list[Bucket]) -> None:
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.flats: list[torch.Tensor] = []
        self.state = FREE
        self.pending: list = []
        self.reduced = 0  # buckets whose gradients were sent in this backward


class ParamSharder:
    """Gathers and frees units around their forward and backward."""

    def __init__(self, plan: ShardPlan, params: Sequence[nn.Parameter],
                 units: Sequence[tuple[str, nn.Module, list[int]]], shards: Shards,
                 sent: Sent) -> None:
        self.plan, self.params, self.shards, self.sent = plan, list(params), shards, sent
        self.keep = False  # True inside no_sync(): stay gathered until the last micro-step
        self.units: list[Unit] = []
        self._unit_of_bucket: dict[int, Unit] = {}
        for index, (name, module, bucket_ids) in enumerate(units):
            unit = Unit(index, name, module, [plan.buckets[b] for b in bucket_ids])
            for b in unit.buckets:
                unit.flats.append(flat_views(b, self.params))
                self._unit_of_bucket[b.index] = unit
            self._free(unit)
            self.units.append(unit)
        self.order: list[Unit] = []  # as the first forward ran them
        self._recording = True
        self._handles = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._post_forward(unit)))

    # gathering and freeing

    def _free(self, unit: Unit) -> None:
        was_full = unit.state != FREE
        t0 = time.perf_counter()
        for flat in unit.flats:
            flat.untyped_storage().resize_(0)
        unit.state = FREE
        if was_full and spans.enabled():
            # One name for every layer's free (the layer in args): one entry in a legend.
            spans.add_span("free", t0, time.perf_counter(), unit=unit.index, module=unit.name)

    def start_gather(self, unit: Unit, prefetch: bool = True) -> None:
        """Start all-gathering a unit's parameters, unless they are already full or on their
        way (`prefetch`: ahead of its use, which the trace tells apart)."""
        if unit.state != FREE:
            return
        for b, flat in zip(unit.buckets, unit.flats, strict=True):
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            self.shards.put_own(b, flat)
        unit.pending = []
        launched = time.perf_counter()
        for b, flat in zip(unit.buckets, unit.flats, strict=True):
            unit.pending += broadcast_shards(b, flat, self.shards.rank, self.sent)
        unit.state = GATHERING
        trace_when_done(unit.pending, f"{'prefetch' if prefetch else 'gather'} {unit.name}",
                        launched, unit=unit.index,
                        bytes=sum(f.numel() * f.element_size() for f in unit.flats))

    def ensure_full(self, unit: Unit) -> None:
        """Make a unit's parameters whole, waiting for a gather in flight."""
        self.start_gather(unit, prefetch=False)
        if unit.state == GATHERING:
            t0 = time.perf_counter()
            for handle in unit.pending:
                handle.wait()
            unit.pending = []
            unit.state = FULL
            if spans.enabled():
                spans.add_span(f"wait gather {unit.name}", t0, time.perf_counter(),
                               track="comm_wait", unit=unit.index)

    def gather_all(self) -> None:
        """Make every unit's parameters whole (for saving or evaluating the full model)."""
        for unit in self.units:
            self.ensure_full(unit)

    def free_all(self) -> None:
        """Free every unit's full parameters, leaving only this rank's shards."""
        for unit in self.units:
            if unit.state == GATHERING:
                self.ensure_full(unit)  # a started gather must finish on every rank
            self._free(unit)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if unit not in self.order:
            return None
        j = self.order.index(unit) + step
        return self.order[j] if 0 <= j < len(self.order) else None

    # hooks

    def _pre_forward(self, unit: Unit):
        def hook(_module, _args) -> None:
            if self._recording and unit not in self.order:
                self.order.append(unit)
            self.ensure_full(unit)
            nxt = self._neighbour(unit, +1)
            if nxt is not None and not self._recording:
                self.start_gather(nxt)
        return hook

    def _post_forward(self, unit: Unit):
        def hook(_module, _args, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            needs_grad = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in needs_grad:
                t.register_hook(self._pre_backward(unit))
            if not self.keep:
                self._free(unit)
            return None
        return hook

    def _pre_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            self._recording = False
            self.ensure_full(unit)
            prev = self._neighbour(unit, -1)
            if prev is not None:
                self.start_gather(prev)
        return hook

    def after_reduce(self, bucket: Bucket) -> None:
        """Called by the gradient reducer: free a unit once all its buckets are sent."""
        unit = self._unit_of_bucket[bucket.index]
        unit.reduced += 1
        if unit.reduced == len(unit.buckets):
            unit.reduced = 0
            if not self.keep:
                if unit.state == GATHERING:
                    self.ensure_full(unit)
                self._free(unit)

    def end_forward_pass(self) -> None:
        """The first forward has run: its order is the prefetch order from now on."""
        self._recording = False
