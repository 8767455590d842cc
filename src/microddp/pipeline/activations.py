"""Activation memory, measured: the bytes autograd keeps for backward, live, on this rank.

Inside `ActivationMeter()`, every tensor autograd saves for a backward passes through a
saved-tensor hook. The meter counts its storage once (a tensor saved by two nodes, or two views
of one storage, is one allocation) for as long as any graph holds it, and forgets it when the
last graph holding it is freed: after its backward, or, for a graph kept with
`retain_graph=True` (zero-bubble's I), after the W that frees it. Parameters are not
activations and are left out. `peak` is the most this rank held at once: what a schedule's
order of forwards and backwards costs in memory, without computing it from a formula.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Held:
    """One saved tensor, as autograd keeps it; its end is when the meter forgets it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple, meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes of saved activations while the block runs; `peak` and `live` in bytes.

    `exclude`: tensors never counted (the model's parameters, which autograd saves too).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[tuple, int] = {}  # storage -> how many saved tensors hold it
        self._bytes: dict[tuple, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() in self._exclude or storage.nbytes() == 0:
            return t
        key = (storage.data_ptr(), t.device)
        if key not in self._refs:
            self._refs[key], self._bytes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        # detached: holding a saved output with its grad_fn would make a reference cycle
        # (the node holds the tensor, the tensor its node), freed only by the garbage collector
        return _Held(t.detach(), key, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (e.g. at the start of a step)."""
        self.peak = self.live

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
