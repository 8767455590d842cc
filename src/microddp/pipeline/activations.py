"""Activation memory, measured: the bytes autograd keeps for backward, live, on this rank.

Inside `ActivationMeter()`, every tensor autograd saves for a backward passes through a
saved-tensor hook. The meter counts its storage once (a tensor saved by two nodes, or two views
of one storage, is one allocation) for as long as any graph holds it, and forgets it when the
last graph holding it is freed: after its backward, or, for a graph kept with
`retain_graph=True` (zero-bubble's I), after the W that frees it. Parameters are not
activations and are left out. `peak` is the most this rank held at once: what a schedule's
order of forwards and backwards costs in memory, without computing it from a formula.

The interpreter's message buffers are activations' memory too, though autograd never saves
them: a receive posted ahead holds its buffer before the forward that reads it, and a send
holds its tensor until it completes, even after the backward freed its graph. `hold(tensor)`
counts such a tensor in every meter entered at the time, until the tensor object is freed
(the storage counted once, shared with whatever autograd saved of it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

_ENTERED: list[ActivationMeter] = []  # the meters whose block is running, innermost last


def hold(tensor: torch.Tensor) -> None:
    """Count `tensor`'s storage in every entered meter for as long as this tensor object
    lives (a message buffer: see the module's text). Outside any meter it does nothing."""
    for meter in _ENTERED:
        key = meter._count(tensor, saved=False)
        if key is not None:
            weakref.finalize(tensor, meter._release, key, False)


class _Held:
    """One saved tensor, as autograd keeps it; its end is when the meter forgets it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple, meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes of activations while the block runs, in bytes: `live` and `peak`
    everything held (saved tensors and message buffers), `live_saved` and `peak_saved` what
    autograd saved alone (a storage that is both counts in both).

    `exclude`: tensors never counted (the model's parameters, which autograd saves too).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        # storage -> [saved tensors holding it, message buffers holding it]
        self._refs: dict[tuple, list[int]] = {}
        self._bytes: dict[tuple, int] = {}
        self.live = self.peak = self.live_saved = self.peak_saved = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _count(self, t: torch.Tensor, saved: bool = True) -> tuple | None:
        """Count one more holder of `t`'s storage (a saved tensor, or a message buffer);
        its key, or None if it is not counted."""
        storage = t.untyped_storage()
        if storage.data_ptr() in self._exclude or storage.nbytes() == 0:
            return None
        key = (storage.data_ptr(), t.device)
        if key not in self._refs:
            self._refs[key], self._bytes[key] = [0, 0], storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        refs = self._refs[key]
        if saved and refs[0] == 0:
            self.live_saved += self._bytes[key]
            self.peak_saved = max(self.peak_saved, self.live_saved)
        refs[0 if saved else 1] += 1
        return key

    def _pack(self, t: torch.Tensor):
        key = self._count(t)
        if key is None:
            return t
        # detached: holding a saved output with its grad_fn would make a reference cycle
        # (the node holds the tensor, the tensor its node), freed only by the garbage collector
        return _Held(t.detach(), key, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple, saved: bool = True) -> None:
        refs = self._refs[key]
        refs[0 if saved else 1] -= 1
        if saved and refs[0] == 0:
            self.live_saved -= self._bytes[key]
        if refs == [0, 0]:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def reset_peak(self) -> None:
        """Start new peaks from what is held now (e.g. at the start of a step)."""
        self.peak, self.peak_saved = self.live, self.live_saved

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        _ENTERED.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ENTERED.remove(self)
        self._hooks.__exit__(*exc)
